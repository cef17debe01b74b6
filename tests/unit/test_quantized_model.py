"""A GGUF served in its quantized blocks (``--quantization gguf``), on tiny random models built
here (int8 per output channel: ``tests/integration/test_int8_weights.py``).

The reference is the same file served dense (``--quantization none``): gguf-py dequantizes
every block to float32 and the model runs float32 ``F.linear``, so the two differ only by the
quantized kernels' arithmetic: activations rounded to int8 per block (llama.cpp's Q8_0/Q8_K),
integer dot products, float scales.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_loader import gguf_copy_metadata, write_tiny_gguf

from radixserve import SamplingParams
from radixserve.entrypoints.llm import LLM
from radixserve.model_executor.kernels.cpu import CpuKernels

#: ggml block sizes in bytes of the K-quants built from random bytes here (gguf-py has no
#: quantizer for them): Q4_K (d, dmin, 12 scale bytes, 128 nibble bytes), Q5_K (plus 32 high-bit
#: bytes), Q6_K (128 low, 64 high, 16 int8 scales, d last)
_K_BLOCK = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}

#: a Q4_K_M-like mix: q/k in Q4_K and v in Q6_K (one fused QKV of two types), the MLP in the
#: three other kernel types, a Q8_0 embedding (the tied LM head)
MIX = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
       "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q8_0", "token_embd": "Q8_0"}


def _random_k_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, cols / 256 * block bytes] of valid random K-quant blocks whose values are
    of order 0.02-0.05 (the d/dmin float16 fields set, the rest random bytes)."""
    nb = cols // 256
    size = _K_BLOCK[kind]
    b = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    if kind == "Q6_K":  # value = d * scale(int8) * (q - 32)
        d = rng.uniform(2e-5, 4e-5, (rows, nb)).astype(np.float16)
        b[:, :, 208:210] = d.view(np.uint8).reshape(rows, nb, 2)
    else:  # value = d * sc * q - dmin * m, 6-bit sc and m
        d = rng.uniform(4e-5, 8e-5, (rows, nb)).astype(np.float16)
        dmin = rng.uniform(2e-5, 6e-5, (rows, nb)).astype(np.float16)
        b[:, :, 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
        b[:, :, 2:4] = dmin.view(np.uint8).reshape(rows, nb, 2)
    return b.reshape(rows, nb * size)


def write_mixed_gguf(src: Path, dst: Path, mix: dict[str, str], seed: int = 0,
                     bias_std: float = 0.0) -> None:
    """``src`` (an F32 GGUF) with each 2-D tensor re-encoded in the type ``mix`` gives its
    base name (``attn_q``, ``token_embd``...): gguf-py's quantizer for Q4_0/Q4_1/Q8_0, random
    blocks for the K-quants. ``bias_std`` > 0 replaces the (zero) Q/K/V biases of a Qwen2 file
    by random ones of that spread."""
    import gguf

    rng = np.random.default_rng(seed)
    reader = gguf.GGUFReader(str(src))
    w = gguf_copy_metadata(reader, dst)
    for t in reader.tensors:
        data = np.array(t.data)
        base = t.name.split(".")[-2]
        kind = mix.get(base)
        if bias_std > 0 and t.name.endswith(".bias"):
            data = rng.normal(0, bias_std, data.shape).astype(data.dtype)
        if data.ndim != 2 or kind is None:
            w.add_tensor(t.name, data)
            continue
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in _K_BLOCK:
            blocks = _random_k_blocks(data.shape[0], data.shape[1], kind, rng)
        else:
            blocks = gguf.quants.quantize(data, qtype)
        w.add_tensor(t.name, blocks, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("quant")
    f32 = d / "f32.gguf"
    # K-quants need rows of a multiple of 256 values
    write_tiny_gguf("llama", f32, tie=True, hidden=256, intermediate=512)
    out = d / "tiny-mixed.gguf"
    write_mixed_gguf(f32, out, MIX)
    return out


PROMPTS = [[5 + (7 * i + 3 * j) % 250 for j in range(n)]
           for i, n in enumerate((40, 9, 23, 64, 3, 17))]


def _prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                        use_tqdm=False)
    return [[lp[tok] for lp, tok in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:],
                                        strict=True)] for o in outs]


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_gguf_served_in_blocks_matches_dequantized(mixed_gguf):
    """Per-token logprobs of the block path within a stated bound of the dequantized float32
    model, each projection on its type's kernel (QKV on two)."""
    quant = LLM(str(mixed_gguf), dtype="float32", num_pages=64, quantization="gguf")
    runner = quant.engine.runner
    assert runner.paths.paths["quantization"] == "gguf"
    assert runner.paths.paths["linear"] == "quantized"
    # the start-up log names the block kernels' instruction set, and AMX where it runs
    qk = (runner.kernels or CpuKernels.load()).quant
    reason = runner.paths.reasons["linear"]
    assert f"{qk.isa} block kernels" in reason
    assert ("AMX-INT8" in reason) == qk.amx_int8
    layer = runner.model.layers[0]
    assert layer.quantized["qkv"].kind == "Q4_K+Q6_K"
    assert {n: m.kind for n, m in layer.quantized.items()} == {
        "qkv": "Q4_K+Q6_K", "o": "Q5_K", "gate_up": "Q4_0+Q4_1", "down": "Q8_0"}
    assert runner.model.embed_q is not None and runner.model.lm_head_q is not None
    assert layer.qkv.numel() == 0  # no dense copy held
    got = _prompt_logprobs(quant, PROMPTS)
    dense = LLM(str(mixed_gguf), dtype="float32", num_pages=64, quantization="none")
    assert dense.engine.runner.paths.paths["quantization"] == "none"
    want = _prompt_logprobs(dense, PROMPTS)
    diffs = [abs(g - w) for gs, ws in zip(got, want, strict=True)
             for g, w in zip(gs, ws, strict=True)]
    # Bound: rounding an activation row to int8 per block moves each value by at most
    # max|x| / 254 of its block, a relative error of ~0.2-0.4% per projection for these
    # rows; through 2 layers and a 300-token softmax it measured 0.024 at most (0.003 on
    # average) here. 0.1 nats is 4x that and still far below what a wrong block layout, scale or row order gives
    # (logprobs off by whole nats: random weights make every token's logprob ~ -5.7).
    assert max(diffs) < 0.1, max(diffs)
    assert sum(diffs) / len(diffs) < 0.02
    assert all(math.isfinite(g) for gs in got for g in gs)


def test_gguf_blocks_batch_invariant(mixed_gguf):
    """Greedy tokens and prompt logprobs of a request alone equal the same request in a batch
    and through chunked prefill: each row's arithmetic does not depend on the batch."""
    llm = LLM(str(mixed_gguf), dtype="float32", num_pages=128, quantization="gguf",
              max_num_batched_tokens=32, enable_prefix_caching=False)
    together = _greedy(llm, PROMPTS)
    alone = [_greedy(llm, [p])[0] for p in PROMPTS]
    assert together == alone
    lp_together = _prompt_logprobs(llm, PROMPTS)
    lp_alone = [_prompt_logprobs(llm, [p])[0] for p in PROMPTS]
    assert lp_together == lp_alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_decode_stack_runs_blocks_with_the_per_op_bits(tmp_path, arch, dtype):
    """Decode steps of a GGUF served in blocks run in the fused C stack (a Qwen2 file's Q/K/V
    bias included), and give the per-op path's bits: the same tokens with the same logprobs."""
    f32 = tmp_path / "f32.gguf"
    write_tiny_gguf(arch, f32, tie=True, hidden=256, intermediate=512)
    path = tmp_path / f"{arch}-mixed.gguf"
    write_mixed_gguf(f32, path, MIX, bias_std=0.5 if arch == "qwen2" else 0.0)
    runs = {}
    for fused in (True, False):
        llm = LLM(str(path), dtype=dtype, num_pages=128, quantization="gguf",
                  fused_decode=fused, enable_prefix_caching=False)
        runner = llm.engine.runner
        assert runner.paths.paths["decode_layers"] == ("fused" if fused else "per-op"), \
            runner.paths.reasons["decode_layers"]
        calls = []
        stack = runner.model.decode_stack
        if fused:
            if arch == "qwen2":
                bias = runner.model.layers[0].qkv_proj.bias
                assert bias is not None and bias.abs().max() > 0.1
            run = stack.run
            stack.run = lambda *a, _run=run, _calls=calls: (_calls.append(a[0].shape[0]), _run(*a))[1]
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                           logprobs=1), use_tqdm=False)
        runs[fused] = [(o.outputs[0].token_ids,
                        [lp[t] for lp, t in zip(o.outputs[0].logprobs,
                                                        o.outputs[0].token_ids, strict=True)])
                       for o in outs]
        if fused:
            assert calls and max(calls) == len(PROMPTS), calls
    assert runs[True] == runs[False]


def test_quantization_refusals(mixed_gguf, tmp_path):
    from radixserve.config import EngineConfig
    from radixserve.model_executor.runner import ModelRunner

    with pytest.raises(ValueError, match="quantization='fp8' is not one of"):
        EngineConfig(model=str(mixed_gguf), quantization="fp8")
    with pytest.raises(ValueError, match="int8 quantizes a float checkpoint"):
        ModelRunner(EngineConfig(model=str(mixed_gguf), quantization="int8", num_pages=8))
    from radixserve.model_executor.quantization import choose_quantization

    with pytest.raises(ValueError, match="needs a GGUF file"):
        choose_quantization("gguf", None, torch.device("cpu"))
    with pytest.raises(ValueError, match="run on CPU"):
        choose_quantization("gguf", mixed_gguf, torch.device("meta"))
    mode, why = choose_quantization(None, mixed_gguf, torch.device("meta"))
    assert mode is None and "dequantized" in why


def test_auto_form_is_measured_then_cached(mixed_gguf, tmp_path, monkeypatch,
                                           seed_kernel_cache):
    """A GGUF with ``--quantization`` unset: blocks or dequantized, measured once on this
    machine and cached."""
    from radixserve.config import EngineConfig
    from radixserve.model_executor.runner import ModelRunner

    seed_kernel_cache(tmp_path / "cache")
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    first = ModelRunner(EngineConfig(model=str(mixed_gguf), dtype="float32", num_pages=8))
    form = first.paths.paths["quantization"]
    assert form in ("gguf", "none")
    assert "measured on a layer and the LM head" in first.paths.reasons["quantization"]
    assert (first.model.quantization is not None) == (form == "gguf")
    assert list((tmp_path / "cache" / "path_choice").glob("gguf-form-*.json"))
    again = ModelRunner(EngineConfig(model=str(mixed_gguf), dtype="float32", num_pages=8))
    assert again.paths.paths["quantization"] == form
    assert "measured before on this machine" in again.paths.reasons["quantization"]


def test_shadow_checks_compare_blocks_with_their_dequantized_weights(mixed_gguf):
    """``--shadow-rate`` with a GGUF in blocks: the reference is the model over the blocks'
    dequantized weights (dense, SDPA); the served tokens are the fast path's."""
    plain = LLM(str(mixed_gguf), dtype="float32", num_pages=64, quantization="gguf")
    shadow = LLM(str(mixed_gguf), dtype="float32", num_pages=64, quantization="gguf",
                 shadow_rate=1.0)
    runner = shadow.engine.runner
    assert runner.paths.paths["quantization"] == "gguf"
    ref = runner.shadow.reference
    assert ref.quantization is None and ref.embed_q is None and ref.lm_head_q is None
    assert torch.equal(ref.layers[0].down, runner.model.layers[0].quantized["down"].weight())
    assert _greedy(shadow, PROMPTS) == _greedy(plain, PROMPTS)
    stats = shadow.engine.get_stats().runner
    assert stats.shadow.steps == stats.steps > 0
    # activations rounded to int8 per block on the fast path only (see the bound above):
    # measured logits at most 0.029 apart, and 2 of 72 argmaxes differing (random weights
    # give near-ties); a wrong dequantization would put whole logits apart
    agree, diverge = stats.shadow.tokens_agree, stats.shadow.tokens_diverge
    assert diverge <= 0.1 * (agree + diverge)
    assert 0 < stats.shadow.max_abs_logit_diff < 0.2


def test_bad_quantized_gguf_fails_at_start_naming_the_tensor(mixed_gguf, tmp_path):
    """A truncated file or a tensor whose shape does not fit the config stops the engine at
    start-up, naming the tensor and its type; nothing is served."""
    from radixserve.config import EngineConfig
    from radixserve.model_executor.runner import ModelRunner

    data = mixed_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) // 2])  # through the blocks of a middle layer
    with pytest.raises(ValueError, match=r"tensor '[^']+' \((Q\d_K|Q\d_\d)\b.*truncated"):
        ModelRunner(EngineConfig(model=str(cut), quantization="gguf", num_pages=8))
    # the config says 5 layers' worth of feed-forward: the file's ffn_up rows no longer fit
    import gguf

    reader = gguf.GGUFReader(str(mixed_gguf))
    w = gguf_copy_metadata(reader, tmp_path / "wide.gguf", {"llama.feed_forward_length": 768})
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_\w+\.weight \(Q4_[01]\).*shape"):
        ModelRunner(EngineConfig(model=str(tmp_path / "wide.gguf"), quantization="gguf",
                                 num_pages=8))
