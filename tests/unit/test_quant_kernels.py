"""The GGUF-quantized linear and embedding kernels (``kernels/quant.py``,
``csrc/quant_kernels.c``) against gguf-py's block formats, for every supported type."""

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from radixserve.model_executor.kernels.cpu import CFLAGS, SOURCES, CpuKernels, build
from radixserve.model_executor.kernels.quant import (
    PACK16,
    SUPPORTED_TYPES,
    QuantKernels,
    block_info,
)

TYPES = [int(QT.Q4_0), int(QT.Q4_1), int(QT.Q5_0), int(QT.Q5_1), int(QT.Q8_0), int(QT.Q4_K),
         int(QT.Q5_K), int(QT.Q6_K)]
#: the 32-value block types (activations quantized per 32 values, blocks taken four at a time)
TYPES_32 = [int(QT.Q4_0), int(QT.Q4_1), int(QT.Q5_0), int(QT.Q5_1), int(QT.Q8_0)]
NAMES = {t: SUPPORTED_TYPES[t] for t in TYPES}
#: the types with the 16-row packed layout (``QuantKernels.pack16``)
PACKABLE = TYPES
PACKABLE_AVX2 = (*TYPES_32, int(QT.Q4_K), int(QT.Q5_K))  # Q6_K stays rows on AVX2 builds


@pytest.fixture(scope="module")
def qk():
    build()  # raises with the compiler's message if the build fails
    return CpuKernels.load().quant


def make_weight(t: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random valid uint8 [n, row_bytes] rows of type t: gguf-py's quantize where it has one,
    else random bytes with sane fp16 scales (every byte pattern is a valid K-quant block)."""
    rng = np.random.default_rng(seed)
    block, nbytes = block_info(t)
    if t in TYPES_32:
        return quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.05, QT(t))
    raw = rng.integers(0, 256, (n, k // block, nbytes), dtype=np.uint8)
    d = (rng.uniform(1e-4, 3e-3, (n, k // block)).astype(np.float16).view(np.uint8)
         .reshape(n, k // block, 2))
    if t == QT.Q6_K:
        raw[..., 208:210] = d
    else:
        raw[..., 0:2] = d
        raw[..., 2:4] = (rng.uniform(1e-4, 3e-3, (n, k // block)).astype(np.float16)
                         .view(np.uint8).reshape(n, k // block, 2))
    return raw.reshape(n, -1)


def quantize_acts(x: np.ndarray, block: int):
    """The kernel's activation quantization in numpy: per block d = amax / 127,
    q = rint(x * (127 / amax)) in float32. Returns (q int64 [M, K], d float32 [M, K / block])."""
    m, k = x.shape
    xb = x.reshape(m, k // block, block).astype(np.float32)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int64)
    return q.reshape(m, k), (amax / np.float32(127)).astype(np.float32)


def reference(t: int, w: np.ndarray, x: np.ndarray, k: int):
    """(y, scale): the kernel's math in float64 on gguf-py's dequantized weights and the
    quantized activations; scale = sum |w| |xq| per output (for a relative bound)."""
    act_block = 32 if t in TYPES_32 else 256
    q, d = quantize_acts(x, act_block)
    xq = (q.reshape(x.shape[0], -1, act_block) * d[..., None].astype(np.float64))
    xq = xq.reshape(x.shape)
    wd = dequantize(w, QT(t)).reshape(w.shape[0], k).astype(np.float64)
    return xq @ wd.T, np.abs(xq) @ np.abs(wd).T


def run(qk, t, w, x, out_dtype=torch.float32, **kw):
    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype)
    qk.linear(t, torch.from_numpy(w), x, out, **kw)
    return out


def run_packed(qk, t, w, x):
    """x @ W^T through the tiles over ``pack16``'s layout of W (rows of blocks, uint8 numpy)."""
    n, k = w.shape[0], x.shape[1]
    p = qk.pack16(t, torch.from_numpy(w))
    x = x.contiguous()
    out = torch.empty(x.shape[0], n)
    qk.linear_unchecked(t | PACK16, p.data_ptr(), n, k, x.data_ptr(), x.dtype, x.shape[0],
                        out.data_ptr(), out.dtype, n)
    return out


@pytest.mark.parametrize("t", TYPES, ids=NAMES.values())
def test_against_references(qk, t):
    block, _ = block_info(t)
    for k in ((256, 4096) if block == 32 else (512, 4096)):
        n, m = 40, 5
        w = make_weight(t, n, k, seed=k)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
        x[1] = 0.0  # an all-zero row: scale 0
        y = run(qk, t, w, x).double().numpy()
        # (a) the same quantized activations, summed in float64: float32 rounding apart
        ref, scale = reference(t, w, x.numpy(), k)
        assert np.all(np.abs(y - ref) <= 5e-7 * scale + 1e-30), np.abs(y - ref).max()
        assert np.all(y[1] == 0.0)
        # (b) F.linear on the dequantized float weights: the activations' quantization error,
        # at most half a step (amax / 254) per value, times |w|
        wd = torch.from_numpy(dequantize(w, QT(t)).reshape(n, k))
        act_block = 32 if block == 32 else 256
        amax = x.abs().reshape(m, -1, act_block).amax(-1).double()  # [m, blocks]
        wabs = wd.abs().reshape(n, -1, act_block).sum(-1).double()  # [n, blocks]
        bound = (amax / 254) @ wabs.T * 1.001 + 1e-5 * (x.abs().double() @ wd.abs().double().T)
        err = (torch.from_numpy(y) - F.linear(x, wd).double()).abs()
        assert torch.all(err <= bound), (err - bound).max()


@pytest.mark.parametrize("t", TYPES, ids=NAMES.values())
def test_batch_invariance_bitwise(qk, t):
    block, _ = block_info(t)
    k, n = 1024, 27  # 27: weight-row tiles of 4 and a remainder
    w = make_weight(t, n, k, seed=3)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(4))
    full = run(qk, t, w, x)
    for m in (1, 2, 3, 5, 17, 64):
        assert torch.equal(run(qk, t, w, x[:m]), full[:m]), m
        assert torch.equal(run(qk, t, w, x[m - 1:m]), full[m - 1:m]), m  # alone
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(5))
    assert torch.equal(run(qk, t, w, x[perm].contiguous()), full[perm])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run(qk, t, w, x), full)
    finally:
        torch.set_num_threads(threads)
    if qk.isa != "portable":  # the portable tiles give the same bits
        for m in (1, 3, 64):
            assert torch.equal(run(qk, t, w, x[:m], portable=True), full[:m]), m


@pytest.mark.parametrize("t", TYPES, ids=NAMES.values())
def test_rows_in_several_passes_keep_their_bits(qk, t):
    """At a long K the activation rows run in passes of ~1 MiB of quantized rows (64-row
    tiles at K = 12288) over weight groups of 16 rows and more: a row's bits must not depend
    on the pass it falls in, nor on the rows beside it."""
    k, n, m = 12288, 40, 150
    w = make_weight(t, n, k, seed=11)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(12))
    full = run(qk, t, w, x)
    for lo, hi in ((0, 1), (63, 64), (64, 130), (129, 150), (140, 141)):
        assert torch.equal(run(qk, t, w, x[lo:hi].contiguous()), full[lo:hi]), (lo, hi)
    if qk.isa != "portable":
        assert torch.equal(run(qk, t, w, x, portable=True), full)
    ref, scale = reference(t, w, x[:3].numpy(), k)
    assert np.all(np.abs(full[:3].double().numpy() - ref) <= 5e-7 * scale + 1e-30)


@pytest.mark.parametrize("t", TYPES, ids=NAMES.values())
def test_out_column_slice_and_bf16(qk, t):
    block, _ = block_info(t)
    k, n, m = 512, 20, 6
    w = make_weight(t, n, k, seed=7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8))
    want = run(qk, t, w, x)
    # (d) out is a column slice of a fused output (the other columns untouched)
    big = torch.full((m, n + 13), 7.0)
    qk.linear(t, torch.from_numpy(w), x, big[:, 5:5 + n])
    assert torch.equal(big[:, 5:5 + n], want)
    assert torch.all(big[:, :5] == 7.0) and torch.all(big[:, 5 + n:] == 7.0)
    # (e) bfloat16: x is widened exactly, out rounded to nearest even
    xb = x.bfloat16()
    want_b = run(qk, t, w, xb.float())
    assert torch.equal(run(qk, t, w, xb), want_b)
    assert torch.equal(run(qk, t, w, xb, out_dtype=torch.bfloat16), want_b.bfloat16())
    bigb = torch.zeros(m, 2 * n, dtype=torch.bfloat16)
    qk.linear(t, torch.from_numpy(w), xb, bigb[:, n:])
    assert torch.equal(bigb[:, n:], want_b.bfloat16()) and torch.all(bigb[:, :n] == 0)


@pytest.mark.parametrize("t", TYPES, ids=NAMES.values())
def test_dequantize_rows_bitwise(qk, t):
    block, _ = block_info(t)
    k, n = 512, 16
    w = make_weight(t, n, k, seed=11)
    wd = torch.from_numpy(dequantize(w, QT(t)).reshape(n, k).astype(np.float32))
    ids = torch.tensor([3, 0, 15, 3, 7], dtype=torch.int64)
    out = torch.empty(5, k)
    qk.dequantize_rows(t, torch.from_numpy(w), ids, out)
    assert torch.equal(out.view(torch.int32), wd[ids].view(torch.int32))
    outb = torch.empty(5, k, dtype=torch.bfloat16)
    qk.dequantize_rows(t, torch.from_numpy(w), ids, outb)
    assert torch.equal(outb, wd[ids].bfloat16())
    out.fill_(1.0)
    with pytest.raises(RuntimeError, match="out of range"):
        qk.dequantize_rows(t, torch.from_numpy(w), torch.tensor([0, n]), out[:2])
    with pytest.raises(RuntimeError, match="out of range"):
        qk.dequantize_rows(t, torch.from_numpy(w), torch.tensor([-1]), out[:1])
    assert torch.all(out == 1.0)


@pytest.mark.parametrize("t", PACKABLE, ids=[NAMES[t] for t in PACKABLE])
def test_dequantize_rows_from_the_packed_layout(qk, t):
    """A tied embedding looks its rows up in the LM head's packed blocks: the same bits as
    from the rows, ids past the rows (into the last group's padding) refused. Portable C."""
    k, n = 512, 21
    w = torch.from_numpy(make_weight(t, n, k, seed=12))
    p = qk.pack16(t, w)
    ids = torch.tensor([20, 0, 15, 16, 3, 20], dtype=torch.int64)
    rows, packed = torch.empty(6, k), torch.empty(6, k)
    qk.dequantize_rows(t, w, ids, rows)
    qk.dequantize_rows(t | PACK16, p, ids, packed, n)
    assert torch.equal(packed.view(torch.int32), rows.view(torch.int32))
    with pytest.raises(RuntimeError, match="out of range"):
        qk.dequantize_rows(t | PACK16, p, torch.tensor([n]), packed[:1], n)
    with pytest.raises(ValueError):  # 21 rows are packed as 32
        qk.dequantize_rows(t | PACK16, p[:16], ids, packed, n)


def test_bad_inputs_raise(qk):
    t = int(QT.Q4_K)
    w = torch.from_numpy(make_weight(t, 8, 512))
    x = torch.randn(3, 512)
    out = torch.empty(3, 8)
    with pytest.raises(ValueError, match="not supported"):
        qk.linear(int(QT.Q2_K), w, x, out)
    with pytest.raises(ValueError, match="uint8"):
        qk.linear(t, w.view(torch.int8), x, out)
    with pytest.raises(ValueError, match="contiguous float32/bfloat16"):
        qk.linear(t, w, x.half(), out)
    with pytest.raises(ValueError, match="contiguous float32/bfloat16"):
        qk.linear(t, w, torch.randn(512, 3).t(), out)
    with pytest.raises(ValueError, match="multiple"):
        qk.linear(t, w, torch.randn(3, 384), out)
    with pytest.raises(ValueError, match="bytes"):
        qk.linear(t, w, torch.randn(3, 256), out)
    with pytest.raises(ValueError, match="expected"):
        qk.linear(t, w, x, torch.empty(3, 9))
    with pytest.raises(ValueError, match="last dim"):
        qk.linear(t, w, x, torch.empty(8, 3).t())
    with pytest.raises(ValueError, match="float32/bfloat16"):
        qk.linear(t, w, x, torch.empty(3, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="int64"):
        qk.dequantize_rows(t, w, torch.tensor([0], dtype=torch.int32), torch.empty(1, 512))
    with pytest.raises(ValueError, match="does not fit"):
        qk.dequantize_rows(t, w, torch.tensor([0]), torch.empty(1, 256))
    with pytest.raises(ValueError, match="not supported"):
        block_info(0)


def test_empty_batch_and_single_column(qk):
    t = int(QT.Q8_0)
    w = torch.from_numpy(make_weight(t, 5, 64))
    qk.linear(t, w, torch.empty(0, 64), torch.empty(0, 5))  # nothing to do
    x = torch.randn(3, 64)
    full = run(qk, t, w.numpy(), x)
    col = torch.full((3, 7), 2.0)
    qk.linear(t, w[2:3].contiguous(), x, col[:, 4:5])  # N = 1: a strided column
    assert torch.equal(col[:, 4], full[:, 2]) and torch.all(col[:, :4] == 2.0)


def test_plain_x86_64_build_gives_the_same_bits(qk, tmp_path):
    """The portable C built for baseline x86-64 (no AVX2, FMA or F16C: libm's fmaf, scalar
    rounding) against this build's default path: the same bits for every type."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or "x86" not in subprocess.run([cc, "-dumpmachine"], capture_output=True,
                                                 text=True).stdout:
        pytest.skip("needs an x86-64 C compiler")
    so = tmp_path / "quant_x86_64.so"
    subprocess.run([cc, *CFLAGS, "-march=x86-64", "-o", str(so), str(SOURCES[1]), "-lm"],
                   check=True, capture_output=True)
    plain = QuantKernels(ctypes.CDLL(str(so)))
    assert plain.isa == "portable"
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(12))
    for t in TYPES:
        w = make_weight(t, 9, 512, seed=t)
        assert torch.equal(run(plain, t, w, x), run(qk, t, w, x)), NAMES[t]


def test_avx2_and_avx512_tiles_give_the_same_bits(qk, tmp_path):
    """Where this build runs the AVX-512 VNNI tiles (K-quants), the same source built with
    the AVX2 tiles only gives the same bits for every type and row count."""
    if qk.isa != "avx512":
        pytest.skip(f"this CPU's build runs the {qk.isa} tiles (no AVX-512 VNNI)")
    cc = shutil.which("cc") or shutil.which("gcc")
    so = tmp_path / "quant_avx2.so"
    subprocess.run([cc, *CFLAGS, "-march=native", "-DRS_Q_NO_AVX512", "-o", str(so),
                    str(SOURCES[1]), "-lm"], check=True, capture_output=True)
    avx2 = QuantKernels(ctypes.CDLL(str(so)))
    assert avx2.isa == "avx2"
    x = torch.randn(19, 768, generator=torch.Generator().manual_seed(13))
    for t in TYPES:
        w = make_weight(t, 11, 768, seed=t + 1)
        for m in (1, 8, 19):
            assert torch.equal(run(avx2, t, w, x[:m]), run(qk, t, w, x[:m])), (NAMES[t], m)
    # the AVX2 tiles read the 16-row packed layout as two 8-output halves
    assert not avx2.has_pack16(int(QT.Q6_K))
    for t in PACKABLE_AVX2:
        assert avx2.has_pack16(t)
        w = make_weight(t, 27, 768, seed=t + 2)
        for m in (1, 5, 19):
            assert torch.equal(run_packed(avx2, t, w, x[:m]), run(qk, t, w, x[:m])), (NAMES[t], m)
        ext, xe = extreme_case(t)
        assert torch.equal(run_packed(avx2, t, ext, xe), run(qk, t, ext, xe)), NAMES[t]


@pytest.mark.parametrize("t", TYPES_32, ids=[NAMES[t] for t in TYPES_32])
@pytest.mark.parametrize("k", [32, 96, 224, 288])
def test_block_groups_with_a_tail(qk, t, k):
    """K / 32 not a multiple of 4 (the tiles take blocks four at a time; the last group is
    partial): the reference bound, the same bits alone and batched, and from the portable tiles."""
    n, m = 11, 10
    w = make_weight(t, n, k, seed=k + t)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    y = run(qk, t, w, x)
    ref, scale = reference(t, w, x.numpy(), k)
    assert np.all(np.abs(y.double().numpy() - ref) <= 5e-7 * scale + 1e-30)
    for i in (0, 7, 9):
        assert torch.equal(run(qk, t, w, x[i:i + 1]), y[i:i + 1])
    assert torch.equal(run(qk, t, w, x, portable=True), y)


@pytest.mark.parametrize("t", TYPES, ids=NAMES.values())
def test_extreme_products_do_not_saturate(qk, t):
    """Every weight at its largest magnitude and every activation at +-amax: the int16 stages
    of the dot products (maddubs pairs, the 4- and 5-bit types' sums of four pairs) and the
    int32 sub-block sums times their scales stay exact, alone and in a tile of many rows."""
    w, x = extreme_case(t)
    k = x.shape[1]
    y = run(qk, t, w, x).double().numpy()
    ref, scale = reference(t, w, x.numpy(), k)
    assert np.all(np.abs(y - ref) <= 5e-7 * scale + 1e-30), np.abs(y - ref).max()
    assert torch.equal(run(qk, t, w, x, portable=True), torch.from_numpy(y).float())
    for i in (0, 4, 8):
        assert torch.equal(run(qk, t, w, x[i:i + 1]), torch.from_numpy(y[i:i + 1]).float())
    if qk.has_pack16(t):  # the packed tiles' int16 stages, alone and in tiles of 9 rows
        assert torch.equal(run_packed(qk, t, w, x), torch.from_numpy(y).float())
        assert torch.equal(run_packed(qk, t, w, x[4:5]), torch.from_numpy(y[4:5]).float())


def extreme_case(t: int) -> tuple[np.ndarray, torch.Tensor]:
    """Every weight at its largest magnitude (uint8 [4, row bytes]) and 9 rows of activations
    at +-amax (float32 [9, 1024])."""
    block, nbytes = block_info(t)
    n, k = 4, 1024
    raw = np.full((n, k // block, nbytes), 0xFF, dtype=np.uint8)
    d = np.full((n, k // block), 1e-3, dtype=np.float16).view(np.uint8).reshape(n, -1, 2)
    if t == QT.Q6_K:
        raw[..., 208:210] = d
    elif t == QT.Q8_0:
        raw[..., 2:] = 0x81  # -127
        raw[..., 0:2] = d
    elif t == QT.Q5_0:
        raw[..., 0:2] = d  # every fifth bit set: q = 31
    else:
        raw[..., 0:2] = d
        raw[..., 2:4] = d
    w = raw.reshape(n, -1)
    x = torch.ones(9, k)  # 9 rows: tiles of many rows (the transposed K-quant tiles) too
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3:] = torch.where(torch.rand(6, k, generator=torch.Generator().manual_seed(t)) < 0.5, -1.0, 1.0)
    return w, x


@pytest.mark.parametrize("t", [int(QT.Q5_0), int(QT.Q5_1)], ids=["Q5_0", "Q5_1"])
def test_q5_fifth_bit_order(qk, t):
    """ggml's Q5 layout, one set bit at a time: value j's fifth bit is bit j of qh read as a
    little-endian uint32 (values 0..15 the low nibbles of qs, 16..31 the high ones); every qh
    byte pattern, through the lookup and the linear (one-hot activations pick single values)."""
    block, nbytes = block_info(t)
    qo = nbytes - 16
    raw = np.zeros((32, nbytes), dtype=np.uint8)
    raw[:, 0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    if t == QT.Q5_1:
        raw[:, 2:4] = np.array([0.25], dtype=np.float16).view(np.uint8)
    for j in range(32):  # row j: only value j's fifth bit
        raw[j, qo - 4:qo] = np.array([1 << j], dtype="<u4").view(np.uint8)
    raw[:, qo:] = np.arange(16, dtype=np.uint8) * 17  # byte i holds nibbles i, i
    wd = dequantize(raw, QT(t)).reshape(32, 32)
    q = np.tile(np.arange(16), 2) + 16 * np.eye(32, dtype=np.int64)
    want = 0.5 * (q - 16) if t == QT.Q5_0 else 0.5 * q + 0.25
    assert np.array_equal(wd, want.astype(np.float32))  # gguf-py agrees with the layout above
    out = torch.empty(32, 32)
    qk.dequantize_rows(t, torch.from_numpy(raw), torch.arange(32), out)
    assert torch.equal(out, torch.from_numpy(wd))
    # activation row i one-hot at i, 127: its scale is 1 and its q 127, so y[i, j] is
    # 127 * value i of weight row j, exactly
    x = 127 * torch.eye(32)
    y = run(qk, t, raw, x)
    assert torch.equal(y, 127 * torch.from_numpy(wd).T)
    assert torch.equal(run(qk, t, raw, x, portable=True), y)



@pytest.mark.parametrize("t", PACKABLE, ids=[NAMES[t] for t in PACKABLE])
def test_pack16_round_trip(qk, t):
    """The 16-row packed layout holds the rows' bytes (the last group padded with zero rows)
    and gives them back: portable C, so every build checks it."""
    k = 288 if block_info(t)[0] == 32 else 512
    for n in (1, 16, 17, 40):
        w = torch.from_numpy(make_weight(t, n, k, seed=n))
        p = qk.pack16(t, w)
        assert p.shape == (-(-n // 16) * 16, w.shape[1])
        assert not torch.equal(p[:n], w) or n == 0  # rearranged, not copied
        assert torch.equal(qk.unpack16(t, p, n), w)
    with pytest.raises(ValueError):  # a type these kernels do not take
        qk.pack16(int(QT.Q2_K), torch.zeros(16, 84, dtype=torch.uint8))
    with pytest.raises(ValueError):  # not whole blocks
        qk.pack16(t, torch.zeros(16, block_info(t)[1] + 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        qk.unpack16(t, p, 16)  # 40 rows' packing is not 16 rows'


@pytest.mark.parametrize("t", PACKABLE, ids=[NAMES[t] for t in PACKABLE])
def test_pack16_tiles_give_the_rows_bits(qk, t):
    """Where the build runs the packed tiles (AVX2, AVX-512 VNNI), W packed gives the bits of the
    rows as stored and of the portable tiles, for every row count (Q4_K: tiles of 16 rows
    below 8 and of 64 from 8 on), a partial last group of 16 outputs, a partial last group
    of four blocks, and bf16 into a column slice."""
    if not qk.has_pack16(t):
        pytest.skip(f"this CPU's build runs the {qk.isa} tiles, which have no packed layout")
    n, k = 40, 288 if block_info(t)[0] == 32 else 512
    w = make_weight(t, n, k, seed=t + 7)
    p = qk.pack16(t, torch.from_numpy(w))
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(t))
    for m in (1, 5, 8, 16, 17, 40, 70):
        rows = run(qk, t, w, x[:m])
        out = torch.empty(m, n)
        qk.linear_unchecked(t | PACK16, p.data_ptr(), n, k, x.data_ptr(), x.dtype, m,
                            out.data_ptr(), out.dtype, n)
        assert torch.equal(out, rows), (NAMES[t], m)
        assert torch.equal(out, run(qk, t, w, x[:m], portable=True)), (NAMES[t], m)
    big = torch.zeros(7, n + 8, dtype=torch.bfloat16)
    xb = x[:7].bfloat16()
    qk.linear_unchecked(t | PACK16, p.data_ptr(), n, k, xb.data_ptr(), xb.dtype, 7,
                        big.data_ptr() + 4 * 2, big.dtype, n + 8)
    assert torch.equal(big[:, 4:4 + n], run(qk, t, w, xb, torch.bfloat16))
    assert not big[:, :4].any() and not big[:, 4 + n:].any()
    with pytest.raises(RuntimeError):  # the portable tiles read rows only
        qk.linear_unchecked(t | PACK16, p.data_ptr(), n, k, x.data_ptr(), x.dtype, 1,
                            out.data_ptr(), out.dtype, n, portable=True)


def test_quantized_linear_holds_packable_segments_packed(qk):
    """``QuantizedLinear`` packs the segments whose type the build runs packed and leaves
    the others as rows; its outputs are the rows' bits and ``weight()`` dequantizes the
    rows the file stored."""
    from radixserve.model_executor.layers.quantized import QuantizedLinear, Segment

    k = 256
    parts = [(int(QT.Q4_1), 40), (int(QT.Q4_K), 16), (int(QT.Q8_0), 24)]
    segs, lo, raws = [], 0, []
    for t, rows in parts:
        w = make_weight(t, rows, k, seed=rows)
        raws.append((t, w, lo))
        segs.append(Segment(lo, lo + rows, t, torch.from_numpy(w)))
        lo += rows
    lin = QuantizedLinear(qk, lo, k, segs)
    for s, (t, _, _) in zip(lin.segments, raws, strict=True):
        assert s.layout == (PACK16 if qk.has_pack16(t) else 0)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(3))
    y = lin(x)
    wt = lin.weight()
    for t, w, at in raws:
        assert torch.equal(y[:, at:at + w.shape[0]], run(qk, t, w, x))
        ref = torch.from_numpy(dequantize(w, QT(t)).reshape(w.shape[0], k))
        assert torch.equal(wt[at:at + w.shape[0]], ref)


@pytest.mark.parametrize("t", [int(QT.Q4_K), int(QT.Q5_K), int(QT.Q6_K)],
                         ids=["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_are_held_packed_at_long_rows(qk, t):
    """Q4_K, Q5_K and Q6_K are held packed where the build has their packed tile (AVX-512: all
    three; AVX2: ``PACKABLE_AVX2``), long rows included (a 7B model's down projection has
    18,944 inputs), with the rows' bits."""
    from radixserve.model_executor.layers.quantized import QuantizedLinear, Segment

    k = 4608
    w = make_weight(t, 20, k, seed=k)
    lin = QuantizedLinear(qk, 20, k, [Segment(0, 20, t, torch.from_numpy(w))])
    assert lin.segments[0].layout == (PACK16 if qk.has_pack16(t) else 0)
    assert qk.has_pack16(t) == (qk.isa == "avx512" or (qk.isa == "avx2" and t in PACKABLE_AVX2))
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(5))
    for m in (1, 9):
        assert torch.equal(lin(x[:m]), run(qk, t, w, x[:m]))


def amx_operand(qk, t: int, w: np.ndarray) -> tuple[int, torch.Tensor]:
    """(type id, weight) in the form the AVX-512 build's AMX tiles read: packed where the
    build packs the type (``has_pack16``), else its rows."""
    if qk.has_pack16(t):
        return t | PACK16, qk.pack16(t, torch.from_numpy(w))
    return t, torch.from_numpy(w)


def run_amx(qk, t: int, w: torch.Tensor, n: int, x: torch.Tensor, amx: str,
            out_dtype=torch.float32) -> torch.Tensor:
    out = torch.empty(x.shape[0], n, dtype=out_dtype)
    qk.linear_unchecked(t, w.data_ptr(), n, x.shape[1], x.data_ptr(), x.dtype, x.shape[0],
                        out.data_ptr(), out.dtype, n, amx=amx)
    return out


@pytest.mark.parametrize("t", TYPES, ids=NAMES.values())
def test_amx_int8_tiles_give_the_same_bits(qk, t):
    """The AMX-INT8 tiles (integer dots from TDPBSUD over the transposed weight dwords, 16
    activation rows per tile) run here on a scalar emulation of the tile instruction, which
    is integer and so exactly the hardware's: every row count (a partial last A tile of 16
    rows, 64-row K-quant tiles), a partial last group of 16 outputs, a partial last group of
    four 32-value blocks and bf16 in and out give the bits of the vpdpbusd tiles and of the
    portable C. The tile instructions themselves run in ``test_amx_int8_tiles_on_this_cpu``
    where the CPU has them."""
    if qk.isa != "avx512":
        pytest.skip(f"the AMX-INT8 tiles are variants of the AVX-512 tiles; this CPU's build "
                    f"runs the {qk.isa} ones")
    n, k = 40, 288 if block_info(t)[0] == 32 else 512
    w = make_weight(t, n, k, seed=t + 21)
    ta, wa = amx_operand(qk, t, w)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(t + 1))
    for m in (1, 5, 8, 16, 17, 40, 64, 70):
        emu = run_amx(qk, ta, wa, n, x[:m], "emulate")
        assert torch.equal(emu, run_amx(qk, ta, wa, n, x[:m], "off")), (NAMES[t], m)
        assert torch.equal(emu, run(qk, t, w, x[:m], portable=True)), (NAMES[t], m)
    xb = x[:19].bfloat16()
    assert torch.equal(run_amx(qk, ta, wa, n, xb, "emulate", torch.bfloat16),
                       run(qk, t, w, xb, torch.bfloat16))
    with pytest.raises(RuntimeError):  # the portable tiles have no AMX variant
        out = torch.empty(1, n)
        qk.linear_unchecked(t, torch.from_numpy(w).data_ptr(), n, k, x.data_ptr(), x.dtype,
                            1, out.data_ptr(), out.dtype, n, portable=True, amx="emulate")
    with pytest.raises(ValueError, match="amx"):
        run_amx(qk, ta, wa, n, x[:1], "always")


def test_amx_int8_tiles_on_this_cpu(qk):
    """Where the CPU has AMX-INT8 (``amx_int8``: the probe at load compared the tile unit
    with the scalar definition), the hardware tiles give the vpdpbusd tiles' bits for every
    type at 16 to 130 rows (full and partial A tiles, several 64-row K-quant tiles), a long
    K and outputs in several groups, and a row alone gives its bits in the batch."""
    if not qk.amx_int8:
        pytest.skip("no AMX-INT8 here (CPUID's AMX-TILE/AMX-INT8 absent, Linux refused the "
                    "tile state, or not an AVX-512 build): the emulation test covers the tiles' "
                    "loops")
    for t in TYPES:
        n, k = 100, 1536 if block_info(t)[0] == 32 else 2048
        w = make_weight(t, n, k, seed=t + 31)
        ta, wa = amx_operand(qk, t, w)
        x = torch.randn(130, k, generator=torch.Generator().manual_seed(t + 2))
        for m in (16, 17, 64, 100, 130):
            hw = run_amx(qk, ta, wa, n, x[:m], "auto")
            assert torch.equal(hw, run_amx(qk, ta, wa, n, x[:m], "off")), (NAMES[t], m)
            assert torch.equal(hw, run_amx(qk, ta, wa, n, x[:m], "emulate")), (NAMES[t], m)
        full = run_amx(qk, ta, wa, n, x, "auto")
        assert torch.equal(run_amx(qk, ta, wa, n, x[77:78].contiguous(), "auto"), full[77:78])
