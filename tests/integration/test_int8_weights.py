"""``--quantization int8``: a float checkpoint's projections and LM head held as int8 with one
scale per output channel, on tiny random checkpoints (Llama with an untied head, Qwen2 with a
tied head and Q/K/V biases).

The independent reference is the dense float32 model whose weights are the dequantized ones
(``q * scale``), served on the dense path: the int8 kernel multiplies by the scale after each
output's sum instead of before, which moves a logit by a few float32 roundings, nothing more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.integration.tiny_models import prompt_logprobs, tiny_model

from radixserve import LLM, SamplingParams
from radixserve.model_executor.layers.int8_weight_linear import (
    Int8WeightLinear,
    quantize_per_channel,
)

PROMPTS = [[5 + (7 * i + 3 * j) % 370 for j in range(n)]
           for i, n in enumerate((40, 9, 23, 64, 3, 17))]
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _dequantized_folder(src: str, dst: Path) -> Path:
    """A copy of checkpoint ``src`` whose projections and LM head hold their int8 values times
    their scales (an untied head: the tied one becomes its own dequantized copy)."""
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    state = load_file(str(Path(src) / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    if cfg.get("tie_word_embeddings"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        cfg["tie_word_embeddings"] = False
        (dst / "config.json").write_text(json.dumps(cfg))
    for name, t in state.items():
        if name == "lm_head.weight" or any(f".{p}.weight" in name for p in _LINEARS):
            q, scale = quantize_per_channel(t)
            state[name] = q.float() * scale[:, None]
    save_file(state, str(dst / "model.safetensors"))
    return dst


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 10) -> list[tuple[list[int],
                                                                        list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                       logprobs=1), use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                     strict=True)]) for o in outs]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True)
               for x, y in zip(xs, ys, strict=True))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_matches_the_dequantized_dense_model(tmp_path, arch):
    folder = tiny_model(tmp_path, arch, initializer_range=0.1)
    int8 = LLM(folder, dtype="float32", num_pages=64, quantization="int8")
    runner = int8.engine.runner
    assert runner.paths.paths["quantization"] == "int8"
    assert runner.paths.paths["linear"] == "quantized"
    model = runner.model
    layer = model.layers[0]
    assert {n: m.kind for n, m in layer.quantized.items()} == {
        "qkv": "int8", "o": "int8", "gate_up": "int8", "down": "int8"}
    assert isinstance(model.lm_head_q, Int8WeightLinear)
    assert model.embed.numel() > 0 and model.embed_q is None  # the lookup stays dense
    assert layer.qkv.numel() == 0 and layer.down.numel() == 0  # no dense copy held
    if arch == "qwen2":
        assert layer.qkv_proj.bias is not None
    got = prompt_logprobs(int8, PROMPTS)
    ref = LLM(str(_dequantized_folder(folder, tmp_path / "deq")), dtype="float32",
              num_pages=64)
    assert ref.engine.runner.paths.paths["quantization"] == "none"
    # the scale multiplies each sum once instead of each product: a few float32 roundings
    # (~1e-7 relative) per logit, measured 2.4e-6 nats at most on the AVX2 kind; a wrong
    # scale, row or panel order moves logprobs by nats
    assert _max_diff(got, prompt_logprobs(ref, PROMPTS)) < 1e-4
    plain = LLM(folder, dtype="float32", num_pages=64)
    # rounding each weight by up to 1/254 of its row's largest: measured 0.060 (llama) and
    # 0.037 (qwen2) nats at most here, the dequantized reference's own distance from it
    assert _max_diff(got, prompt_logprobs(plain, PROMPTS)) < 0.15


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_fused_stack_per_op_and_batch_give_the_same_bits(tmp_path, dtype):
    """Decode steps run in the fused C stack (the Q/K/V bias and, under bfloat16, the rows
    widened and rounded back in C) with the per-op path's bits, and a request alone gets the
    tokens and logprobs it gets in a batch."""
    folder = tiny_model(tmp_path, "qwen2", initializer_range=0.1)
    runs = {}
    for fused in (True, False):
        llm = LLM(folder, dtype=dtype, num_pages=128, quantization="int8",
                  fused_decode=fused, enable_prefix_caching=False,
                  max_num_batched_tokens=32)
        runner = llm.engine.runner
        assert runner.paths.paths["decode_layers"] == ("fused" if fused else "per-op"), \
            runner.paths.reasons["decode_layers"]
        calls: list[int] = []
        if fused:
            stack = runner.model.decode_stack
            run = stack.run
            stack.run = lambda *a, _run=run, _calls=calls: (_calls.append(a[0].shape[0]),
                                                            _run(*a))[1]
        runs[fused] = _greedy(llm, PROMPTS)
        if fused:
            assert calls and max(calls) == len(PROMPTS), calls
            assert [_greedy(llm, [p])[0] for p in PROMPTS] == runs[True]
    assert runs[True] == runs[False]


def test_shadow_checks_compare_int8_with_its_dequantized_weights(tmp_path):
    """``--shadow-rate`` with int8 weights: the reference is the model over ``q * scale``
    (dense, SDPA), which the int8 path matches to float32 rounding."""
    folder = tiny_model(tmp_path, "qwen2", initializer_range=0.1)
    llm = LLM(folder, dtype="float32", num_pages=64, quantization="int8", shadow_rate=1.0)
    ref = llm.engine.runner.shadow.reference
    assert ref.quantization is None and ref.layers[0].quantized == {}
    head = llm.engine.runner.model.lm_head_q
    assert torch.equal(ref.lm_head, head.weight())  # the tied head's int8 copy, dequantized
    _greedy(llm, PROMPTS)
    stats = llm.engine.get_stats().runner
    assert stats.shadow.steps == stats.steps > 0
    assert stats.shadow.tokens_diverge == 0
    assert stats.shadow.max_abs_logit_diff < 1e-3
