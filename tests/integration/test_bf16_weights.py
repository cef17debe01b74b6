"""A bfloat16 checkpoint served in float32 on CPU keeps its weights in bf16, as shipped: half
the memory and half the bytes a decode step reads, and the same tokens and logprobs as the
float32 reference path that widens them at load (``layers.bf16_weight_linear``), batched and
alone, through the per-op path and the fused decode stack. On every CPU kind (the dtype is
asked for, not left to ``auto``)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from radixserve import LLM, SamplingParams


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_checkpoint_served_in_float32_holds_bf16_weights(tmp_path, arch: str) -> None:
    folder = tiny_model(tmp_path, arch, initializer_range=0.2, save_dtype=torch.bfloat16)
    kw = dict(model=folder, dtype="float32", seed=0, num_pages=64, page_size=16,
              max_model_len=256)
    fast = LLM(**kw)
    runner = fast.engine.runner
    paths = runner.paths.paths
    assert paths["weights"] == "bfloat16", runner.paths.reasons["weights"]
    assert paths["linear"] == "bf16-weights"
    assert paths["decode_layers"] == "fused", runner.paths.reasons["decode_layers"]
    model = runner.model
    assert model.norm.dtype == torch.float32
    layer = model.layers[0]
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        op = getattr(layer, name)
        assert op.packed.dtype == torch.bfloat16, name
    # dense copies freed: the only full-size tensors left are the packed bf16 ones
    assert layer.qkv.numel() == 0 and model.embed.numel() == (
        0 if model.lm_head is None else model.embed.numel())
    if arch == "qwen2":  # tied: the embedding is looked up in the LM head's packed weights
        assert model.embed_rows is model._lm_head_proj
    else:
        assert model.embed.dtype == torch.bfloat16

    ref = LLM(**kw, cpu_linear_kernel=False)
    rp = ref.engine.runner.paths.paths
    assert rp["weights"] == "float32" and ref.engine.runner.model.norm.dtype == torch.float32
    per_op = LLM(**kw, fused_decode=False)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": list(range(3 + 5 * i, 30 + 9 * i))} for i in range(5)]
    want = ref.generate(prompts, sp, use_tqdm=False)
    for llm in (fast, per_op):
        together = llm.generate(prompts, sp, use_tqdm=False)
        alone = llm.generate(prompts[3:4], sp, use_tqdm=False)[0]
        for got, w in zip([*together, alone], [*want, want[3]], strict=True):
            assert got.outputs[0].token_ids == w.outputs[0].token_ids
            lp_got = got.outputs[0].logprobs
            lp_want = w.outputs[0].logprobs
            for a, b in zip(lp_got, lp_want, strict=True):
                assert a.keys() == b.keys()
                for t in a:
                    assert a[t] == pytest.approx(b[t], abs=1e-4)
    assert len({tuple(o.outputs[0].token_ids) for o in want}) > 1


def test_float32_checkpoint_stays_float32(tmp_path) -> None:
    folder = tiny_model(tmp_path, "llama")
    llm = LLM(model=folder, dtype="float32", seed=0, num_pages=32, page_size=16,
              max_model_len=128)
    runner = llm.engine.runner
    assert runner.paths.paths["weights"] == "float32"
    assert "not all BF16" in runner.paths.reasons["weights"]
    assert runner.paths.paths["linear"] != "bf16-weights"
