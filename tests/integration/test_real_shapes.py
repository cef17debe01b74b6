"""The fast CPU paths hold at the layer shapes of the models people serve, not only at the
default model's (hidden 576): a random-weight model with Qwen2.5-0.5B's exact layer shapes
(hidden 896, intermediate 4864, 14 heads over 2 KV heads, a 151,936-row tied vocabulary; two
one layer instead of 24, which changes nothing per layer) and one with Llama-3.2-1B's, through the
packed linear kernel, the row cap measured on its shapes and the fused decode stack, in the
machine's default dtype, must give the tokens and logprob values of the per-op oneDNN
reference, batched and alone."""

from __future__ import annotations

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.bench.make_model import make_model

pytestmark = pytest.mark.slow


#: (shape, layers, vocabulary override): Qwen2.5-0.5B whole, for its 151,936-row tied LM head
#: and Q/K/V bias (added after the product, in the fused stack too); Llama-3.2-1B's layers
#: (hidden 2048, intermediate 8192, 32 heads over 8) with the tokenizer's vocabulary
CASES = [("qwen2.5-0.5b", 1, None), ("llama-3.2-1b", 1, 49152)]


@pytest.mark.parametrize("shape,layers,vocab", CASES)
def test_fast_paths_hold_at_real_shapes(tmp_path, shape: str, layers: int,
                                        vocab: int | None) -> None:
    made = make_model(shape, tmp_path / shape, num_layers=layers, vocab_size=vocab, seed=3)
    kw = dict(model=str(made.folder), dtype="auto", seed=0, num_pages=96, page_size=16,
              max_model_len=512)
    fast = LLM(**kw)
    runner = fast.engine.runner
    a = runner.args
    expect = {"qwen2.5-0.5b": (896, 4864, 14, 2, 151936),
              "llama-3.2-1b": (2048, 8192, 32, 8, 49152)}[shape]
    assert (a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads,
            a.vocab_size) == expect
    has = (runner.packed_weights and runner.kernels is not None
           and runner.kernels.has_linear_kernel(runner.dtype))
    linear = runner.paths.paths["linear"]
    if linear in ("amx", "bf16-weights"):
        # the AMX kind in bfloat16 (no oneDNN to match), or float32 activations over the bf16
        # checkpoint's weights as shipped (the kind without native bf16): radixserve's own
        # GEMM for every row count, and the fused stack over it
        assert runner.paths.paths["decode_layers"] == "fused", \
            runner.paths.reasons["decode_layers"]
        if linear == "bf16-weights" and runner.dtype == torch.float32:
            assert runner.model.norm.dtype == torch.float32
            assert runner.paths.paths["weights"] == "bfloat16"
        elif linear == "bf16-weights":  # a bf16 model on the float32 GEMM, measured faster
            assert runner.paths.paths["bf16_gemm"] == "float32"
    elif has:
        # every real shape was probed; whether the kernel reproduces oneDNN there is the
        # machine's answer (on the AMX kind oneDNN's bf16 GEMM runs on tiles, and no K
        # blocking matches), and the paths must follow it
        blocks = runner.model.kernel_k_blocks
        h, it, v = a.hidden_size, a.intermediate_size, a.vocab_size
        qkv = (a.num_heads + 2 * a.num_kv_heads) * a.head_dim
        layer = ((h, h), (2 * it, h), (h, it), (qkv, h))
        assert all(s in blocks for s in (*layer, (v, h))), blocks
        found = [blocks[s] is not None for s in layer]
        assert (runner.kernel_rows is not None) == any(found)
        assert runner.paths.paths["decode_layers"] == ("fused" if all(found) else "per-op"), \
            runner.paths.reasons["decode_layers"]
    # the per-op reference: oneDNN's GEMM, which the packed kernel reproduces; on the AMX kind
    # the AMX GEMM per op (it owns its sums; oneDNN's tile GEMM is not reproducible). Under
    # bf16 weights, the reference widens them at load and runs oneDNN's float32 GEMM: the
    # kernel takes oneDNN's K blocking, so the bits must agree there too; a bf16 model whose
    # linears measured faster on the float32 GEMM compares with that GEMM per op
    # A bf16 model on the float32 GEMM has no oneDNN path of its arithmetic either: its
    # reference is the same GEMM per op
    own = linear == "amx" or (linear == "bf16-weights" and runner.dtype == torch.bfloat16)
    ref = LLM(**kw, fused_decode=False, **({} if own else {"cpu_linear_kernel": False}))
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 140 + 11 * i))} for i in range(4)]
    together = fast.generate(prompts, sp, use_tqdm=False)
    alone = fast.generate(prompts[2:3], sp, use_tqdm=False)[0]
    want = ref.generate(prompts, sp, use_tqdm=False)
    for got, w in zip([*together, alone], [*want, want[2]], strict=True):
        assert got.outputs[0].token_ids == w.outputs[0].token_ids
        assert got.outputs[0].logprobs == w.outputs[0].logprobs
    # not a degenerate model: different prompts give different tokens
    assert len({tuple(o.outputs[0].token_ids) for o in together}) > 1
