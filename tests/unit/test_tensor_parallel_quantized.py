"""Tensor parallelism over quantized weights (real processes, Gloo on CPU): each rank holds its
rows of the column-parallel projections, embedding and LM head in blocks, and its columns of
the row-parallel ones where they fall on block boundaries (dense otherwise); int8 per output
channel shards exactly. Two ranks give one rank's greedy tokens and, within the float32
rounding of the split reductions (and the int8 activation steps it can tip), its logprobs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_loader import write_tiny_gguf
from test_quantized_model import write_mixed_gguf
from tests.integration.tiny_models import TINY_VOCAB, tiny_model

from radixserve import LLM, SamplingParams
from radixserve.config import EngineConfig
from radixserve.model_executor.runner import ModelRunner

#: block-32 types in the row-parallel projections (o, down): a split at K / 2 keeps every
#: activation block whole, so each block's integer products are the one rank's
ALIGNED = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q8_0",
           "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q4_0", "token_embd": "Q8_0"}


@pytest.fixture(autouse=True)
def _restore_threads():
    """Rank 0 lives in this process and sets torch's thread count to its share of the cores."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _run(path: str, size: int, prompts: list[list[int]], **kw) -> list:
    llm = LLM(model=path, dtype="float32", page_size=4, num_pages=256,
              max_num_batched_tokens=48, tensor_parallel_size=size, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    try:
        assert llm.engine.runner.stats().paths["quantization"] == kw["quantization"]
        return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def _assert_same(one: list, many: list, tol: float = 1e-4) -> None:
    for k, (a, b) in enumerate(zip(one, many, strict=True)):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids, f"prompt {k}"
        for la, lb in zip(ca.logprobs, cb.logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < tol for t in la), f"prompt {k}"


#: two ranks' split sums of a row-parallel projection round differently from one rank's in
#: the last bit, and the block kernels round every activation block to int8 (llama.cpp's
#: scheme): a last-bit change can move one activation by a rounding step, d = amax / 127,
#: which moves a logit by about d * |w|, ~1e-3 on this model (measured: 2.8e-3 at most, on
#: 1 of 3 prompts; int8 weights keep activations float, so 1e-4 holds there)
GGUF_TP_TOL = 1e-2


def test_int8_two_ranks_equal_one(tmp_path: Path) -> None:
    path = tiny_model(tmp_path, "qwen2", 0.2)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, TINY_VOCAB, size=n).tolist() for n in (4, 17, 60)]
    _assert_same(_run(path, 1, prompts, quantization="int8"),
                 _run(path, 2, prompts, quantization="int8"))


def test_gguf_blocks_two_ranks_equal_one(tmp_path: Path) -> None:
    f32 = tmp_path / "f32.gguf"
    write_tiny_gguf("llama", f32, tie=True, hidden=256, intermediate=512)
    path = tmp_path / "aligned.gguf"
    write_mixed_gguf(f32, path, ALIGNED)
    prompts = [[5, 9, 40, 200, 31], list(range(20, 70)), [7, 7, 7]]
    _assert_same(_run(str(path), 1, prompts, quantization="gguf"),
                 _run(str(path), 2, prompts, quantization="gguf"), GGUF_TP_TOL)


def test_a_rank_holds_its_share_in_blocks_and_cut_blocks_dense(tmp_path: Path) -> None:
    """Rank 0 of 2 (loaded here without its peer): Q/K/V, gate/up, the embedding and LM head
    as its row share of the blocks; ``down``'s K = 512 splits into whole Q8_0 blocks; ``o``'s
    K = 256 in Q4_K (256-value blocks) cannot split, so its half is dense."""
    f32 = tmp_path / "f32.gguf"
    write_tiny_gguf("llama", f32, tie=True, hidden=256, intermediate=512)
    path = tmp_path / "mixed.gguf"
    write_mixed_gguf(f32, path, dict(ALIGNED, attn_output="Q4_K", ffn_down="Q8_0"))
    rank0 = ModelRunner(EngineConfig(model=str(path), dtype="float32", num_pages=8,
                                     quantization="gguf", tensor_parallel_size=2), tp_rank=0)
    m = rank0.model
    layer = m.layers[0]
    assert {n: q.kind for n, q in layer.quantized.items()} == {
        "qkv": "Q4_K+Q6_K", "gate_up": "Q4_0+Q4_1", "down": "Q8_0"}
    # "o" is not among them: its 128 input columns of 256 are dense (packed for oneDNN)
    assert layer.o_proj.__class__.__name__ != "QuantizedLinear"
    # 2 of 4 query heads and 1 of 2 KV heads, of 64
    assert layer.quantized["down"].k == 256 and layer.quantized["qkv"].n == 128 + 2 * 64
    assert m.embed_q is not None and m.lm_head_q is not None
    assert m.embed_q.table.hi == m.shard.vocab_rows
