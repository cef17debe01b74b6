"""The suite's numpy K-quant quantizer (``tests/integration/kquant.py``): its bytes read back
by gguf-py's dequantization (the reference radixserve's kernels are checked against) give
exactly the values of a per-sub-block reference of its formula, within the rounding bounds
that formula allows; and its per-tensor type choice is llama.cpp's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize
from tests.integration import kquant

F32 = np.float32
PEERS_PYTHON = Path(__file__).resolve().parents[2] / ".venv-peers" / "bin" / "python"


def _ratio(num, den):
    return F32(0) if den == 0 else F32(num / den)


def reference_q4_q5_k(block: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """One float32 [256] super-block through the quantizer's formula, one 32-value sub-block
    at a time: (the values ``d * sc * q - dmin * m`` as gguf-py computes them, float32 [256];
    the per-element error bound [256])."""
    nmax = F32((1 << bits) - 1)
    subs = block.reshape(8, 32)
    mins = [min(F32(s.min()), F32(0)) for s in subs]
    scales = [F32((s.max() - mn) / nmax) for s, mn in zip(subs, mins, strict=True)]
    d = F32(np.float16(max(scales) / F32(63)))
    dmin = F32(np.float16(max(-mn for mn in mins) / F32(63)))
    out, bound = np.empty(256, F32), np.empty(256, F32)
    for i, s in enumerate(subs):
        sc = F32(min(max(np.rint(_ratio(scales[i], d)), 0), 63))
        m = F32(min(max(np.rint(_ratio(-mins[i], dmin)), 0), 63))
        step, offset = F32(d * sc), F32(dmin * m)
        for j, x in enumerate(s):
            q = F32(min(max(np.rint(_ratio(F32(x + offset), step)), 0), nmax))
            out[32 * i + j] = F32(step * q) - offset
        # half a step; where sc or m was rounded down, the clipped ends move by up to
        # nmax * d / 2 and dmin / 2 (plus fp16's rounding of d, relative 2^-11)
        bound[32 * i:32 * i + 32] = (step / 2 + nmax * d / 2 + dmin / 2
                                     + 1e-3 * (scales[i] * nmax + 1e-30))
    return out, bound


def reference_q6_k(block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """As ``reference_q4_q5_k`` for Q6_K: 16-value sub-blocks, ``d * sc * (q - 32)``."""
    subs = block.reshape(16, 16)
    scales = [F32(np.abs(s).max() / F32(31)) for s in subs]
    d = F32(np.float16(max(scales) / F32(127)))
    out, bound = np.empty(256, F32), np.empty(256, F32)
    for i, s in enumerate(subs):
        sc = F32(min(max(np.rint(_ratio(scales[i], d)), 0), 127))
        step = F32(d * sc)
        for j, x in enumerate(s):
            q = F32(min(max(np.rint(_ratio(x, step)), -32), 31))
            out[16 * i + j] = step * q
        bound[16 * i:16 * i + 16] = step / 2 + 31 * d / 2 + 1e-3 * scales[i] * 31
    return out, bound


def _reference(rows: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    blocks = rows.reshape(-1, 256)
    pairs = [reference_q6_k(b) if name == "Q6_K"
             else reference_q4_q5_k(b, 4 if name == "Q4_K" else 5) for b in blocks]
    return (np.stack([p[0] for p in pairs]).reshape(rows.shape),
            np.stack([p[1] for p in pairs]).reshape(rows.shape))


def _rows(seed: int) -> np.ndarray:
    """float32 [6, 512]: Gaussian rows at different scales, plus sub-blocks that are all
    positive, all negative, all zero, one outlier, and a near-zero one beside large ones."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 512)).astype(F32) * F32(0.05)
    x[1] *= F32(40)
    x[2, :64] = np.abs(x[2, :64])
    x[2, 64:128] = -np.abs(x[2, 64:128])
    x[2, 128:160] = 0
    x[3] = 0
    x[4, 7] = 3.0
    x[5, :16] *= F32(1e-4)
    return x


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_layout_and_rounding_against_the_reference(name):
    x = _rows(0)
    packed = kquant.quantize_k(x, name)
    assert packed.dtype == np.uint8 and packed.shape == (6, 2 * kquant.BLOCK_BYTES[name])
    got = dequantize(packed, QT[name]).reshape(x.shape)
    want, bound = _reference(x, name)
    np.testing.assert_array_equal(got, want)
    assert (np.abs(got - x) <= bound).all()
    assert not got[3].any()  # zeros stay zeros
    assert np.isclose(got[4, 7], 3.0, rtol=0.02)  # an outlier sets its sub-block's scale


@pytest.mark.parametrize(("name", "rms"), [("Q4_K", 0.09), ("Q5_K", 0.045), ("Q6_K", 0.022)])
def test_round_trip_error(name, rms):
    """Relative RMS error on Gaussian weights, about half a step of 16, 32 and 64 levels."""
    x = np.random.default_rng(1).standard_normal((64, 1536)).astype(F32) * F32(0.02)
    err = dequantize(kquant.quantize_k(x, name), QT[name]).reshape(x.shape) - x
    assert np.sqrt((err ** 2).mean()) / x.std() < rms


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_deterministic_and_row_independent(name):
    x = np.random.default_rng(2).standard_normal((8, 768)).astype(F32)
    a = kquant.quantize_k(x, name)
    assert np.array_equal(a, kquant.quantize_k(x.copy(), name))
    assert np.array_equal(a[3:5], kquant.quantize_k(x[3:5], name))
    assert np.array_equal(a, kquant.quantize_k(x.astype(np.float64), name))


def test_rows_must_be_whole_super_blocks():
    with pytest.raises(ValueError, match="whole 256-value super-blocks, got 576"):
        kquant.quantize_k(np.zeros((2, 576), F32), "Q4_K")
    with pytest.raises(ValueError, match="not a K-quant"):
        kquant.quantize_k(np.zeros((2, 256), F32), "Q4_0")


# llama.cpp 0.3.36's quantizer on SmolLM2-135M (30 layers, tied embedding, rows of 576 and
# 1536 values): only ffn_down (1536) keeps a K-quant; the 576-wide rest falls back
MORE_BITS = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]


@pytest.mark.parametrize(("mix", "base", "fallback"), [("Q4_K_M", "Q4_K", "Q5_0"),
                                                        ("Q5_K_M", "Q5_K", "Q5_1")])
def test_mix_types_of_the_default_model(mix, base, fallback):
    def t(name, columns):
        return kquant.mix_type(mix, name, columns, 30, tied_output=True)

    assert t("token_embd.weight", 576) == "Q8_0"  # the tied output: Q6_K, fallen back
    assert kquant.mix_type(mix, "token_embd.weight", 576, 30, tied_output=False) == fallback
    assert t("output.weight", 1024) == "Q6_K"
    assert [i for i in range(30) if t(f"blk.{i}.ffn_down.weight", 1536) == "Q6_K"] == MORE_BITS
    assert {t(f"blk.{i}.ffn_down.weight", 1536) for i in range(30)} == {"Q6_K", base}
    assert [i for i in range(30) if t(f"blk.{i}.attn_v.weight", 576) == "Q8_0"] == MORE_BITS
    for proj in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert t(f"blk.4.{proj}.weight", 576) == fallback
        assert t(f"blk.4.{proj}.weight", 4096) == base


def _has_llama_cpp() -> bool:
    return PEERS_PYTHON.exists() and subprocess.run(
        [str(PEERS_PYTHON), "-c", "import llama_cpp"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_llama_cpp(),
                    reason="llama-cpp-python is not in .venv-peers (make bench-peers)")
def test_mix_types_are_llama_cpp_quantizers(tmp_path):
    """The default model quantized by llama.cpp itself into each mix has, tensor by tensor,
    the types ``mix_type`` names and the file type ``MIX_FILE_TYPE`` names."""
    import gguf

    from radixserve.model_executor.loader import resolve_model

    src = resolve_model(None).gguf
    script = ("import ctypes, sys, llama_cpp\n"
              "for dst, ftype in zip(sys.argv[2::2], sys.argv[3::2], strict=True):\n"
              "    p = llama_cpp.llama_model_quantize_default_params()\n"
              "    p.ftype, p.allow_requantize, p.nthread = int(ftype), True, 2\n"
              "    assert llama_cpp.llama_model_quantize(sys.argv[1].encode(), dst.encode(),"
              " ctypes.byref(p)) == 0\n")
    args = [a for mix, ftype in kquant.MIX_FILE_TYPE.items()
            for a in (str(tmp_path / f"{mix}.gguf"), str(ftype))]
    subprocess.run([str(PEERS_PYTHON), "-c", script, str(src), *args],
                   check=True, capture_output=True, timeout=300)
    assert kquant.MIX_FILE_TYPE == {"Q4_K_M": 15, "Q5_K_M": 17}  # llama_ftype's MOSTLY_*
    for mix, ftype in kquant.MIX_FILE_TYPE.items():
        r = gguf.GGUFReader(str(tmp_path / f"{mix}.gguf"))
        assert r.fields["general.file_type"].contents() == ftype
        n_layers = r.fields["llama.block_count"].contents()
        for t in r.tensors:
            if len(t.shape) == 2:  # gguf-py's shape is ggml's: [columns, rows]
                assert t.tensor_type.name == kquant.mix_type(
                    mix, t.name, int(t.shape[0]), n_layers, tied_output=True), (mix, t.name)
