"""ctypes wrapper of ``csrc/quant_kernels.c``: linears and embedding lookups on GGUF-quantized
weights served as the file stores them (issue 30), built into the same shared object as the
other CPU kernels (``cpu.build``); ``CpuKernels.load().quant`` is an instance.

A weight is a contiguous ``uint8`` tensor [N, row_bytes]: row n is output n's K values as
``K / values_per_block`` consecutive ggml blocks (``row_bytes = K / values_per_block *
bytes_per_block``), the bytes of a GGUF tensor of ggml shape [K, N] as they lie in the file.
Block layouts are ggml's (``ggml-common.h``: ``block_q4_0``, ``block_q4_1``, ``block_q5_0``,
``block_q5_1``, ``block_q8_0``, ``block_q4_K``, ``block_q5_K``, ``block_q6_K``), the ones
gguf-py's ``gguf.quants`` dequantizes; the C source's header restates them.

``linear`` quantizes the activations per block once per call, as llama.cpp does (int8 with a
float32 scale per 32 values for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights, plus the scaled sum for
Q4_1/Q5_1; per 256 values with 16-value sums for the K-quants), and sums integer dot products
per block. Each output is one fixed sequence of float operations whatever the batch (M), the
other rows of the call, the thread count or the code path (portable C, AVX2, AVX-512 VNNI, or
AMX-INT8 tiles for the integer dots where the CPU has them): y[i, j] is bitwise the same alone
or batched.
"""

from __future__ import annotations

import ctypes

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

#: ggml type id -> name, for the types these kernels take
SUPPORTED_TYPES: dict[int, str] = {
    int(GGMLQuantizationType.Q4_0): "Q4_0",
    int(GGMLQuantizationType.Q4_1): "Q4_1",
    int(GGMLQuantizationType.Q5_0): "Q5_0",
    int(GGMLQuantizationType.Q5_1): "Q5_1",
    int(GGMLQuantizationType.Q8_0): "Q8_0",
    int(GGMLQuantizationType.Q4_K): "Q4_K",
    int(GGMLQuantizationType.Q5_K): "Q5_K",
    int(GGMLQuantizationType.Q6_K): "Q6_K",
}
_DT = {torch.float32: 0, torch.bfloat16: 1}
#: flag of a weight type id (``linear_unchecked``'s ``ggml_type | PACK16``): W is in the
#: 16-row packed layout of ``QuantKernels.pack16``
PACK16 = 0x100
#: the types ``QuantKernels.pack16`` lays out (which of them a build runs packed:
#: ``QuantKernels.has_pack16``)
PACK16_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
#: ``amx`` argument -> rs_quant_linear's flag bits (2: no AMX tiles, 4: their emulation)
_AMX_FLAGS = {"auto": 0, "off": 2, "emulate": 4}
_ERRORS = {1: "bad type or sizes", 2: "a row id out of range (nothing written)",
           3: "out of memory", 5: "a build without AVX2 + FMA"}


def block_info(ggml_type: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a supported ggml type (gguf's
    ``GGML_QUANT_SIZES``).

    Raises:
        ValueError: a type these kernels do not take.
    """
    if ggml_type not in SUPPORTED_TYPES:
        raise ValueError(f"ggml type {ggml_type} is not supported (supported: "
                         f"{', '.join(f'{k} {v}' for k, v in SUPPORTED_TYPES.items())})")
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one weight row of ``k`` values (``k`` a multiple of the block).

    Raises:
        ValueError: unsupported type, or ``k`` not a positive multiple of the block size.
    """
    block, nbytes = block_info(ggml_type)
    if k <= 0 or k % block:
        raise ValueError(f"{SUPPORTED_TYPES[ggml_type]} needs K a positive multiple of {block}, "
                         f"got {k}")
    return k // block * nbytes


class QuantKernels:
    """The quantized-weight entry points of a loaded kernel library (``CpuKernels.quant``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        fn = lib.rs_quant_linear
        fn.argtypes = [c_int, ptr, i64, i64, c_int, ptr, i64, c_int, ptr, i64, c_int, c_int]
        fn.restype = c_int
        self._linear = fn
        fn = lib.rs_quant_dequantize_rows
        fn.argtypes = [c_int, ptr, i64, i64, ptr, i64, c_int, ptr, c_int]
        fn.restype = c_int
        self._dequant = fn
        fn = lib.rs_quant_pack16
        fn.argtypes = [c_int, ptr, i64, i64, ptr, c_int, c_int]
        fn.restype = c_int
        self._pack16 = fn
        fn = lib.rs_quant_has_pack16
        fn.argtypes = [c_int]
        fn.restype = c_int
        self._has_pack16 = fn
        fn = lib.rs_quant_isa
        fn.argtypes = []
        fn.restype = c_int
        #: the tiles this build runs: "avx512" (AVX-512 BW + VNNI), "avx2" (AVX2 + FMA +
        #: F16C) or "portable" (plain C); the same bits on each
        self.isa = {2: "avx512", 1: "avx2"}.get(fn(), "portable")
        fn = lib.rs_quant_amx
        fn.argtypes = []
        fn.restype = c_int
        #: whether tiles of 16 rows and more take their integer dot products from AMX-INT8
        #: tiles (``TDPBSUD``): an AVX-512 build on a CPU with AMX-TILE and AMX-INT8, Linux
        #: granted the tile state, and a probe gave the scalar definition's integers. The
        #: integers are exact, so the bits are the vpdpbusd tiles'
        self.amx_int8 = bool(fn())
        # the int8-weight GEMM lives in cpu_kernels.c: a library of quant_kernels.c alone
        # (the plain-x86-64 build the tests compare) has the block kernels only
        fn = getattr(lib, "rs_linear_f32_i8w", None)
        if fn is not None:
            fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, c_int]
            fn.restype = c_int
        self._int8w = fn
        #: whether the float32 GEMM (AVX2 + FMA or AVX-512) that runs int8 weights is built
        self.has_int8w = fn is not None and bool(lib.rs_has_f32_gemm())

    def has_pack16(self, ggml_type: int) -> bool:
        """Whether this build's tiles run ``ggml_type`` in the 16-row packed layout
        (``pack16``): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K on AVX2 and AVX-512 VNNI builds
        (the AVX2 tiles read a 16-row group as two 8-output halves), Q6_K on AVX-512 VNNI builds
        only (on AVX2 its packed tile measured slower than the rows' at one row); none on the
        portable one. Where it does, weights are held packed: the packed tiles
        give the rows' bits and measured faster at every shape tried."""
        return bool(self._has_pack16(ggml_type))

    def pack16(self, ggml_type: int, w: torch.Tensor) -> torch.Tensor:
        """W's rows in the 16-row packed layout that the AVX2 and AVX-512 tiles of Q4_0, Q4_1,
        Q5_0, Q5_1, Q8_0, Q4_K and Q5_K, and the AVX-512 tiles of Q6_K, read without transposing
        (``csrc/quant_kernels.c``, ``rs_quant_pack16``): rows in groups of 16, each group's
        blocks back to back, each block's 16 rows' values lane by lane, then (Q5_0, Q5_1)
        their fifth bits or (Q4_K, Q5_K) their scale bytes the same way and (Q5_K) its 32 qh
        bytes, then their fp16 scales (and Q4_1's and Q5_1's mins, the K-quants' dmins);
        Q6_K's ql, qh and int8 scales are all value vectors, then its fp16 d. A decode-sized
        call spent most of its time rearranging each block into that order
        (Q4_1 [3072, 576] at one row on the avx512_bf16 VM: 34.8 us from the rows, 17.7 us
        packed).

        Args:
            ggml_type: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K's type id.
            w: contiguous uint8 [N, row_bytes] rows of ggml blocks.

        Returns:
            uint8 [ceil(N / 16) * 16, row_bytes]: the last group padded with zero rows (the
            same bytes per group as the rows).

        Raises:
            ValueError: another type, or w not contiguous uint8 rows of its blocks.
        """
        return self._repack(ggml_type, w, -(-w.shape[0] // 16) * 16, 0)

    def unpack16(self, ggml_type: int, packed: torch.Tensor, n: int) -> torch.Tensor:
        """The ``n`` rows of ggml blocks (uint8 [n, row_bytes]) that ``pack16`` packed into
        ``packed``.

        Raises:
            ValueError: another type, or ``packed`` not ``pack16``'s shape for ``n`` rows.
        """
        if packed.dim() != 2 or packed.shape[0] != -(-n // 16) * 16:
            raise ValueError(f"packed holds {tuple(packed.shape)}, not {n} rows in groups "
                             f"of 16")
        return self._repack(ggml_type, packed, n, 1)

    def _repack(self, ggml_type: int, w: torch.Tensor, rows_out: int,
                direction: int) -> torch.Tensor:
        _, nbytes = block_info(ggml_type)
        if SUPPORTED_TYPES[ggml_type] not in PACK16_TYPES:
            raise ValueError(f"{SUPPORTED_TYPES[ggml_type]} has no 16-row packed layout")
        if (w.dtype != torch.uint8 or w.dim() != 2 or not w.is_contiguous()
                or w.shape[1] % nbytes or w.device.type != "cpu"):
            raise ValueError(f"w must be contiguous CPU uint8 rows of "
                             f"{SUPPORTED_TYPES[ggml_type]} blocks, got {w.dtype} "
                             f"{tuple(w.shape)}")
        out = torch.empty(rows_out, w.shape[1], dtype=torch.uint8)
        n = w.shape[0] if direction == 0 else rows_out
        rc = self._pack16(ggml_type, w.data_ptr(), n, w.shape[1] // nbytes, out.data_ptr(),
                          direction, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"rs_quant_pack16 failed with code {rc}")
        return out

    def linear_int8w(self, x_ptr: int, w_ptr: int, scale_ptr: int, out_ptr: int, m: int,
                     n: int, k: int, k_block: int) -> None:
        """``out = (x @ Wq.T) * scale`` in float32 for int8 weights packed ``[N/64][K][64]``
        with one float32 scale per output (``layers.int8_weight_linear``): each output one
        chain of float32 FMAs over the widened int8 values, restarted every ``k_block``
        inputs, times its scale; the same chain for every M. On raw addresses: x float32
        [M, K], out float32 [M, N] (N % 64 == 0), scale float32 [N], all contiguous; the
        caller checks them.

        Raises:
            RuntimeError: the kernel's error code (1 bad sizes, 3 out of memory, 5 a build
                without AVX2 + FMA).
        """
        if self._int8w is None:
            raise RuntimeError("int8-weight linear kernel failed with code 5 (this library "
                               "has no float32 GEMM)")
        rc = self._int8w(x_ptr, w_ptr, scale_ptr, out_ptr, m, n, k, k_block,
                         torch.get_num_threads())
        if rc:
            raise RuntimeError(f"int8-weight linear kernel failed with code {rc} "
                               f"({_ERRORS.get(rc, 'unknown')})")

    def linear(self, ggml_type: int, w: torch.Tensor, x: torch.Tensor, out: torch.Tensor, *,
               portable: bool = False, amx: str = "auto") -> None:
        """``out = x @ W.T`` for a quantized weight W, written into ``out``.

        Args:
            ggml_type: ggml type id of W, a key of ``SUPPORTED_TYPES``.
            w: contiguous uint8 [N, row_bytes], row_bytes = K / block * block bytes
                (``block_info``): N rows of raw ggml blocks.
            x: contiguous float32 or bfloat16 [M, K], finite (a block holding an infinity or
                NaN gives unspecified outputs for its row).
            out: float32 or bfloat16 [M, N], last dim contiguous, row stride free (it may be
                a column slice ``big[:, lo:hi]`` of a fused output); written.
            portable: run the portable C tiles even where AVX2 ones are built (the same bits;
                for tests).
            amx: "auto" (AMX-INT8 tiles where ``amx_int8``, from 16 rows), "off" (the
                vpdpbusd tiles), or "emulate" (the AMX tiles' loops on a scalar emulation of
                the tile instruction at every row count, on any AVX-512 build; for tests).

        Raises:
            ValueError: unsupported type, or wrong dtypes, shapes or layouts (the message
                names which).
            RuntimeError: the kernel's error code (1: bad sizes, 3: out of memory).
        """
        block, _ = block_info(ggml_type)
        if w.dtype != torch.uint8 or w.dim() != 2 or not w.is_contiguous():
            raise ValueError(f"w must be a contiguous uint8 [N, row_bytes] tensor, got "
                             f"{w.dtype} {tuple(w.shape)}")
        if x.dtype not in _DT or x.dim() != 2 or not x.is_contiguous():
            raise ValueError(f"x must be a contiguous float32/bfloat16 [M, K] tensor, got "
                             f"{x.dtype} {tuple(x.shape)}")
        if out.dtype not in _DT or out.dim() != 2:
            raise ValueError(f"out must be float32/bfloat16 [M, N], got {out.dtype} "
                             f"{tuple(out.shape)}")
        m, k = x.shape
        n = w.shape[0]
        if k % block or k == 0:
            raise ValueError(f"K = {k} is not a positive multiple of "
                             f"{SUPPORTED_TYPES[ggml_type]}'s block of {block}")
        if w.shape[1] != row_bytes(ggml_type, k):
            raise ValueError(f"w rows hold {w.shape[1]} bytes; K = {k} of "
                             f"{SUPPORTED_TYPES[ggml_type]} needs {row_bytes(ggml_type, k)}")
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out is {tuple(out.shape)}, expected (M, N) = {(m, n)}")
        if any(t.device.type != "cpu" for t in (w, x, out)):
            raise ValueError("w, x and out must be CPU tensors")
        if (n > 1 and out.stride(1) != 1) or (m > 1 and out.stride(0) < n):
            raise ValueError(f"out's last dim must be contiguous with row stride >= N, got "
                             f"strides {out.stride()}")
        self.linear_unchecked(ggml_type, w.data_ptr(), n, k, x.data_ptr(), x.dtype, m,
                              out.data_ptr(), out.dtype, max(out.stride(0), n),
                              portable=portable, amx=amx)

    def linear_unchecked(self, ggml_type: int, w_ptr: int, n: int, k: int, x_ptr: int,
                         x_dtype: torch.dtype, m: int, out_ptr: int, out_dtype: torch.dtype,
                         ldo: int, *, portable: bool = False, amx: str = "auto") -> None:
        """``linear`` on raw addresses for a caller that checked the tensors once (the decode
        path calls it many times per step).

        Args:
            ggml_type: ggml type id (``SUPPORTED_TYPES``), or ``id | PACK16`` for W in
                ``pack16``'s layout (where ``has_pack16``).
            w_ptr: address of N * row_bytes weight bytes (packed: N rounded up to 16).
            n, k: output features N and input features K (K a multiple of the block).
            x_ptr, x_dtype: address of contiguous [M, K] float32/bfloat16 activations.
            m: rows M.
            out_ptr, out_dtype: address of [M, N] float32/bfloat16 output, element (i, j) at
                ``i * ldo + j``.
            ldo: out's row stride in elements (>= N).
            portable, amx: as ``linear``'s.

        Raises:
            ValueError: ``amx`` not one of "auto", "off", "emulate".
            RuntimeError: the kernel's error code (1: bad type or sizes, or a packed W with
                ``portable`` or on a build without its tile, or "emulate" on a build without
                AVX-512; 3: out of memory).
        """
        if amx not in _AMX_FLAGS:
            raise ValueError(f"amx must be one of {sorted(_AMX_FLAGS)}, got {amx!r}")
        flags = (1 if portable else 0) | _AMX_FLAGS[amx]
        rc = self._linear(ggml_type, w_ptr, n, k, _DT[x_dtype], x_ptr, m, _DT[out_dtype],
                          out_ptr, ldo, flags, torch.get_num_threads())
        if rc:
            raise RuntimeError(f"quantized linear kernel failed with code {rc} "
                               f"({_ERRORS.get(rc, 'unknown')})")

    def dequantize_rows(self, ggml_type: int, w: torch.Tensor, ids: torch.Tensor,
                        out: torch.Tensor, n: int | None = None) -> None:
        """Embedding lookup: ``out[t] = dequantize(W[ids[t]])``, with gguf-py's float32
        arithmetic (bit for bit its ``dequantize`` in float32; bfloat16 out rounds that to
        nearest even).

        Args:
            ggml_type: ggml type id (``SUPPORTED_TYPES``), or ``id | PACK16`` for W in
                ``pack16``'s layout (a tied embedding shares its LM head's packed blocks).
            w: contiguous uint8 [N, row_bytes] (rows of raw ggml blocks; packed:
                ``ceil(n / 16) * 16`` rows' bytes).
            ids: contiguous int64 [T], each in [0, n).
            out: contiguous float32 or bfloat16 [T, K]; written.
            n: the rows W holds (default ``w.shape[0]``); packed W's last group may hold
                padding rows past it.

        Raises:
            ValueError: unsupported type, wrong dtypes, shapes or layouts.
            RuntimeError: an id out of range (code 2; nothing written), or code 1 (bad sizes).
        """
        n = w.shape[0] if n is None else n
        packed = ggml_type & PACK16
        ggml_type &= ~PACK16
        if packed and (SUPPORTED_TYPES.get(ggml_type) not in PACK16_TYPES
                       or w.shape[0] != -(-n // 16) * 16):
            raise ValueError(f"w holds {tuple(w.shape)}, not {n} rows of "
                             f"{SUPPORTED_TYPES.get(ggml_type)} in groups of 16")
        if not 0 <= n <= w.shape[0]:
            raise ValueError(f"n = {n} rows, but w holds {w.shape[0]}")
        block, _ = block_info(ggml_type)
        if w.dtype != torch.uint8 or w.dim() != 2 or not w.is_contiguous():
            raise ValueError(f"w must be a contiguous uint8 [N, row_bytes] tensor, got "
                             f"{w.dtype} {tuple(w.shape)}")
        if ids.dtype != torch.int64 or ids.dim() != 1 or not ids.is_contiguous():
            raise ValueError(f"ids must be a contiguous int64 [T] tensor, got {ids.dtype} "
                             f"{tuple(ids.shape)}")
        if (out.dtype not in _DT or out.dim() != 2 or not out.is_contiguous()
                or out.shape[0] != ids.shape[0]):
            raise ValueError(f"out must be a contiguous float32/bfloat16 [T, K] tensor with "
                             f"T = {ids.shape[0]}, got {out.dtype} {tuple(out.shape)}")
        k = out.shape[1]
        if k % block or k == 0 or w.shape[1] != row_bytes(ggml_type, k):
            raise ValueError(f"out's K = {k} does not fit w's rows of {w.shape[1]} bytes of "
                             f"{SUPPORTED_TYPES[ggml_type]}")
        if any(t.device.type != "cpu" for t in (w, ids, out)):
            raise ValueError("w, ids and out must be CPU tensors")
        rc = self._dequant(ggml_type | packed, w.data_ptr(), n, k, ids.data_ptr(),
                           ids.shape[0], _DT[out.dtype], out.data_ptr(),
                           torch.get_num_threads())
        if rc:
            raise RuntimeError(f"dequantize_rows failed with code {rc} "
                               f"({_ERRORS.get(rc, 'unknown')})")
