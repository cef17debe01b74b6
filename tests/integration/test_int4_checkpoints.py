"""AWQ and GPTQ 4-bit safetensors checkpoints: written here from a tiny random model the way
AutoAWQ and AutoGPTQ pack them, served as ggml blocks (``--quantization awq`` / ``gptq``, the
default for such a checkpoint) and dequantized (``--quantization none``).

The reference is a plain float32 checkpoint holding ``(q - zero) * scale``: the dequantized
path must give its bits exactly (the unpacking of every nibble, zero and scale is right), and
the block path the block kernels' bound (activations rounded to int8 per block)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.integration.tiny_models import prompt_logprobs, tiny_model

from radixserve import LLM

PROMPTS = [[5 + (7 * i + 3 * j) % 370 for j in range(n)]
           for i, n in enumerate((40, 9, 23, 64, 3, 17))]
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
#: AutoAWQ's packing order: nibble i of an int32 holds column AWQ_PACK[i] of its 8
AWQ_PACK = (0, 2, 4, 6, 1, 3, 5, 7)


def _quantize(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int64 [N, K] in 0..15, zeros int64 [N, K/G], scales float16 [N, K/G])."""
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP, GROUP)
    if sym:
        s = (g.abs().amax(-1) / 7).half()
        z = torch.full(s.shape, 8, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / 15).half()
        z = torch.round(-lo / s.float()).clamp(0, 15).to(torch.int64)
    q = (torch.round(g / s.float()[..., None]) + z[..., None]).clamp(0, 15).to(torch.int64)
    return q.reshape(n, k), z, s


def _pack_cols(v: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int64 [R, C] (C % 8 == 0) -> int32 [R, C / 8]: nibble i of word j = column 8j + order[i]."""
    r, c = v.shape
    v = v.reshape(r, c // 8, 8)
    word = torch.zeros(r, c // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        word |= v[:, :, col] << (4 * i)
    return ((word + 2**31) % 2**32 - 2**31).to(torch.int32)  # the same 32 bits, signed


def _int4_folder(src: str, dst: Path, method: str, sym: bool) -> tuple[Path, Path]:
    """``src`` as an AWQ or GPTQ checkpoint at ``dst``, plus a float32 twin holding the
    dequantized weights at ``dst``-ref. Returns (int4 folder, reference folder)."""
    ref = dst.with_name(dst.name + "-ref")
    for d in (dst, ref):
        d.mkdir()
        for f in Path(src).iterdir():
            if f.suffix != ".safetensors":
                (d / f.name).write_bytes(f.read_bytes())
    state = load_file(str(Path(src) / "model.safetensors"))
    packed, deq = {}, {}
    seq = tuple(range(8))
    for name, t in state.items():
        if not any(f".{p}.weight" in name for p in _LINEARS):
            packed[name] = t.half() if t.dim() == 2 else t
            deq[name] = packed[name].float()
            continue
        prefix = name.removesuffix(".weight")
        q, z, s = _quantize(t, sym)
        deq[name] = ((q.reshape(*z.shape, GROUP) - z[..., None]).float()
                     * s.float()[..., None]).reshape(q.shape)
        if method == "awq":
            packed[prefix + ".qweight"] = _pack_cols(q.T.contiguous(), AWQ_PACK)  # [K, N/8]
            packed[prefix + ".qzeros"] = _pack_cols(z.T.contiguous(), AWQ_PACK)  # [K/G, N/8]
        else:
            packed[prefix + ".qweight"] = _pack_cols(q, seq).T.contiguous()  # [K/8, N]
            packed[prefix + ".qzeros"] = _pack_cols(z.T.contiguous() - 1, seq)  # stored - 1
            packed[prefix + ".g_idx"] = torch.arange(t.shape[1], dtype=torch.int32) // GROUP
        packed[prefix + ".scales"] = s.T.contiguous()  # [K/G, N]
    save_file(packed, str(dst / "model.safetensors"))
    save_file(deq, str(ref / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["torch_dtype"] = "float16"
    cfg["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
         "version": "gemm"} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
         "sym": sym, "checkpoint_format": "gptq"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, ref


@pytest.mark.parametrize("method,sym,kind", [("awq", False, "Q4_1"), ("gptq", True, "Q4_0"),
                                             ("gptq", False, "Q4_1")])
def test_int4_checkpoint_served_in_blocks_and_dequantized(tmp_path, method, sym, kind):
    src = tiny_model(tmp_path, "qwen2", initializer_range=0.1)
    folder, ref_folder = _int4_folder(src, tmp_path / method, method, sym)
    ref = prompt_logprobs(LLM(str(ref_folder), dtype="float32", num_pages=64), PROMPTS)
    dense = LLM(str(folder), dtype="float32", num_pages=64, quantization="none")
    assert dense.engine.runner.paths.paths["quantization"] == "none"
    # the same float32 values as the reference checkpoint: the same bits
    assert prompt_logprobs(dense, PROMPTS) == ref
    served = LLM(str(folder), dtype="float32", num_pages=64)  # the default for such a folder
    runner = served.engine.runner
    assert runner.paths.paths["quantization"] == method
    layer = runner.model.layers[0]
    assert {n: m.kind for n, m in layer.quantized.items()} == {
        "qkv": kind, "o": kind, "gate_up": kind, "down": kind}
    assert layer.qkv.numel() == 0
    got = prompt_logprobs(served, PROMPTS)
    worst = max(abs(a - b) for xs, ys in zip(got, ref, strict=True)
                for a, b in zip(xs, ys, strict=True))
    # activations rounded to int8 per block of 32 (the GGUF kernels' arithmetic; Q4_1's
    # m = -zero * scale also rounded to float16): measured 0.029 (Q4_1) and 0.038 (Q4_0)
    # nats at most on the AVX2 kind, where a wrong nibble order or group puts logprobs whole
    # nats apart
    assert worst < 0.1, worst


def test_int4_refusals(tmp_path):
    src = tiny_model(tmp_path, "llama", initializer_range=0.1)
    folder, _ = _int4_folder(src, tmp_path / "awq", "awq", False)
    with pytest.raises(ValueError, match="needs a 4-bit GPTQ checkpoint"):
        LLM(str(folder), num_pages=16, quantization="gptq")
    with pytest.raises(ValueError, match="int8 quantizes a float checkpoint"):
        LLM(str(folder), num_pages=16, quantization="int8")
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for field, value, match in (("bits", 8, "bits=8"), ("group_size", 48, "group_size=48"),
                                ("version", "gemv", "version='gemv'")):
        bad = dict(cfg, quantization_config=dict(cfg["quantization_config"], **{field: value}))
        cfg_path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            LLM(str(folder), num_pages=16)
    bad = dict(cfg, quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 32,
                                         "desc_act": True})
    cfg_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="desc_act"):
        LLM(str(folder), num_pages=16)
    bad = dict(cfg, quantization_config={"quant_method": "fp8"})
    cfg_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="quant_method='fp8'"):
        LLM(str(folder), num_pages=16)
