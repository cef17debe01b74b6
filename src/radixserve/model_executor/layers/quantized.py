"""Linear layers whose weights stay quantized: ggml blocks (GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K) read from the file as they are (int8 per output channel made at load, ``--quantization
int8``, is ``layers.int8_weight_linear``).

A projection is a list of row segments, each in its own format: llama.cpp's ``Q4_K_M`` files
store ``attn_v`` (and ``ffn_down``) of some layers in Q6_K and ``attn_q``/``attn_k`` in Q4_K, so
the fused QKV projection has segments of two types, each computed by its own kernel straight
into its columns of one output. A segment whose type has no kernel (Q2_K, Q3_K, the IQ
types, ...) holds dense rows in the serving dtype instead and runs ``F.linear``.

The quantized kernels (``kernels/quant.py``) quantize each activation row per block and sum
integer products, the same operations for a row whatever the batch, so greedy decoding stays
batch invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from radixserve.model_executor.kernels.quant import (
    PACK16,
    SUPPORTED_TYPES,
    QuantKernels,
    block_info,
    row_bytes,
)


@dataclass
class Segment:
    """Rows ``[lo, hi)`` of a projection's output features.

    Attributes:
        lo, hi: output rows (features) this segment computes.
        ggml_type: the ggml type of ``data``, None for dense rows, or ``INT8_CHANNEL``
            (``layers.int8_weight_linear``) for int8 rows with a scale each.
        data: uint8 ``[hi - lo, row_bytes]`` ggml blocks, ``[hi - lo, K]`` dense rows in the
            serving dtype, or int8 ``[hi - lo, K]``.
        scale: float32 ``[hi - lo]``, the int8 rows' scales; else None.
        layout: 0 for rows as the file stores them, or ``PACK16``: ``data`` is
            ``QuantKernels.pack16``'s layout of them (``ceil((hi - lo) / 16) * 16`` rows).
    """

    lo: int
    hi: int
    ggml_type: int | None
    data: torch.Tensor
    scale: torch.Tensor | None = None
    layout: int = 0

    @property
    def kernel_type(self) -> int | None:
        """The type id the kernels take: ``ggml_type``, with ``layout``'s flag."""
        return None if self.ggml_type is None else self.ggml_type | self.layout


class QuantizedLinear:
    """``x [M, K] -> [M, N]``: ``x @ W.T + bias`` with W held as ``segments``.

    Args:
        quant: the loaded quantized kernels.
        n, k: output and input features.
        segments: covering ``[0, n)`` in order, without overlap. Block segments of a type
            the build runs packed (``QuantKernels.has_pack16``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
            Q4_K and Q5_K on AVX2 and AVX-512 builds, Q6_K on AVX-512) are replaced by their
            packed copy; the same outputs, bit for bit.
        bias: [n] in the activation dtype, or None.

    Raises:
        ValueError: segments that do not tile ``[0, n)``, or a segment of the wrong shape.
    """

    def __init__(self, quant: QuantKernels, n: int, k: int, segments: list[Segment],
                 bias: torch.Tensor | None = None) -> None:
        at = 0
        for s in segments:
            held = -(-(s.hi - s.lo) // 16) * 16 if s.layout else s.hi - s.lo
            if s.lo != at or s.hi <= s.lo or s.data.shape[0] != held:
                raise ValueError(f"segments must tile [0, {n}) in order, got rows "
                                 f"[{s.lo}, {s.hi}) with {s.data.shape[0]} rows after {at}")
            if s.layout and (s.layout != PACK16 or not quant.has_pack16(s.ggml_type)):
                raise ValueError(f"segment [{s.lo}, {s.hi}) has layout {s.layout:#x}, which "
                                 f"this build's kernels do not run")
            if s.ggml_type is None and s.data.shape[1] != k:
                raise ValueError(f"dense segment [{s.lo}, {s.hi}) has {s.data.shape[1]} "
                                 f"columns, expected {k}")
            if s.ggml_type is not None and (
                    s.data.dtype != torch.uint8 or not s.data.is_contiguous()
                    or k % block_info(s.ggml_type)[0]
                    or s.data.shape[1] != row_bytes(s.ggml_type, k)):
                raise ValueError(f"segment [{s.lo}, {s.hi}) holds {tuple(s.data.shape)} "
                                 f"{s.data.dtype}, not contiguous uint8 rows of "
                                 f"{GGMLQuantizationType(s.ggml_type).name} blocks for K={k}")
            at = s.hi
        if at != n:
            raise ValueError(f"segments cover [0, {at}), expected [0, {n})")
        self.quant, self.n, self.k = quant, n, k
        self.segments = [
            Segment(s.lo, s.hi, s.ggml_type, quant.pack16(s.ggml_type, s.data), s.scale, PACK16)
            if s.ggml_type in SUPPORTED_TYPES and not s.layout and quant.has_pack16(s.ggml_type)
            else s for s in segments]
        self.bias = bias

    @property
    def kind(self) -> str:
        """The formats held, e.g. ``Q4_K+Q6_K`` (``dense`` for unquantized segments)."""
        names = []
        for s in self.segments:
            name = "dense" if s.ggml_type is None else GGMLQuantizationType(s.ggml_type).name
            if name not in names:
                names.append(name)
        return "+".join(names)

    def nbytes(self) -> int:
        """Bytes of the weights as held."""
        return sum(s.data.numel() * s.data.element_size() for s in self.segments)

    def weight(self) -> torch.Tensor:
        """The weight as float32 [N, K]: each block segment dequantized (``dequantize_rows``,
        gguf-py's arithmetic), dense segments as held (a reference copy for shadow checks and
        tests)."""
        out = torch.empty(self.n, self.k, dtype=torch.float32)
        for s in self.segments:
            if s.ggml_type is None:
                out[s.lo:s.hi] = s.data.float()
            else:
                ids = torch.arange(s.hi - s.lo, dtype=torch.int64)
                self.quant.dequantize_rows(s.kernel_type, s.data, ids, out[s.lo:s.hi],
                                           s.hi - s.lo)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32/bfloat16 -> [M, N] of x's dtype.

        Raises:
            ValueError: x of another dtype, device or width.
        """
        if (x.dim() != 2 or x.shape[1] != self.k or x.device.type != "cpu"
                or x.dtype not in (torch.float32, torch.bfloat16)):
            raise ValueError(f"quantized linear needs CPU float32/bfloat16 [M, {self.k}], got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        m = x.shape[0]
        out = torch.empty(m, self.n, dtype=x.dtype)
        size = out.element_size()
        for s in self.segments:
            if s.ggml_type is None:
                out[:, s.lo:s.hi] = F.linear(x, s.data)
            else:
                # checked once at construction: segment shapes, the blocks' row bytes
                self.quant.linear_unchecked(s.kernel_type, s.data.data_ptr(), s.hi - s.lo,
                                            self.k, x.data_ptr(), x.dtype, m,
                                            out.data_ptr() + s.lo * size, out.dtype, self.n)
        if self.bias is not None:
            out += self.bias
        return out


class QuantizedEmbedding:
    """Token embedding rows looked up from ggml blocks, dequantized per looked-up row.

    Args:
        quant: the loaded quantized kernels.
        table: the ``[0, vocab_rows)`` block segment: rows as stored (uint8
            ``[vocab_rows, row_bytes]``) or, for an embedding tied to a packed LM head, that
            head's ``PACK16`` segment (the lookup gathers a row from its group).
        dim: values per row (the hidden size).
        dtype: the activation dtype rows are returned in.

    Raises:
        ValueError: a dense or int8 segment.
    """

    def __init__(self, quant: QuantKernels, table: Segment, dim: int,
                 dtype: torch.dtype) -> None:
        if table.ggml_type not in SUPPORTED_TYPES or table.lo != 0:
            raise ValueError(f"an embedding table of ggml blocks from row 0, got type "
                             f"{table.ggml_type} from row {table.lo}")
        self.quant, self.table = quant, table
        self.dim, self.dtype = dim, dtype
        #: the blocks' type name (``Q6_K``)
        self.kind = GGMLQuantizationType(table.ggml_type).name

    def weight(self) -> torch.Tensor:
        """Every row dequantized, float32 [vocab_rows, dim]."""
        out = torch.empty(self.table.hi, self.dim, dtype=torch.float32)
        self.quant.dequantize_rows(self.table.kernel_type, self.table.data,
                                   torch.arange(self.table.hi, dtype=torch.int64), out,
                                   self.table.hi)
        return out

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 ids [T] -> [T, dim] in ``dtype``.

        Raises:
            RuntimeError: an id outside the table (the kernel's check).
        """
        out = torch.empty(ids.shape[0], self.dim, dtype=self.dtype)
        self.quant.dequantize_rows(self.table.kernel_type, self.table.data, ids.contiguous(),
                                   out, self.table.hi)
        return out
