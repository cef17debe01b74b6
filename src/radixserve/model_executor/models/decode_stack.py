"""A decode step's whole layer stack in one C call (``rs_decode_layers``).

Why: in a decode step every layer makes ~10 calls from Python into the C kernels (add +
RMSNorm, four linears, RoPE, the K/V store, attention, SiLU-and-multiply), each with argument
checks, tensor allocations and a ctypes crossing: about 70 us per layer on the Zen 5 VM, 2 ms of
a batch-1 step that streams its weights in ~5 ms. The C function runs the same kernels in the
same order on the same data, so it gives the per-op path's bits exactly; the checks are made
once per step here instead of once per op.

It applies where every op of the per-op path is one of those kernels: each projection either
packed weights (bf16 or float32) through radixserve's linear kernel (``packed_kernel``), the AMX
GEMM (``layers.amx_linear``), bf16 weights under float32 (``layers.bf16_weight_linear``), int8
per output channel (``layers.int8_weight_linear``) or GGUF blocks through the quantized kernels
(``layers.quantized``, every segment quantized), the "cpu"
attention backend, no tensor parallelism, no Q/K norm, a Q/K/V bias added after the product
(as the packed and the quantized projections add it; one inside oneDNN's GEMM cannot be), and a
step of decodes only with at most the packed kernel's ``max_rows`` rows. Any other step runs the
per-op path (``CausalLM.forward``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from radixserve.model_executor.attention.paged_attention import (
    AttentionMetadata,
    CpuKernelPagedAttention,
)
from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.layers.amx_linear import AmxLinear
from radixserve.model_executor.layers.bf16_weight_linear import Bf16WeightLinear
from radixserve.model_executor.layers.int8_weight_linear import Int8WeightLinear
from radixserve.model_executor.layers.packed_kernel import PackedLinearKernel
from radixserve.model_executor.layers.quantized import QuantizedLinear

if TYPE_CHECKING:
    from radixserve.model_executor.models.llama import DecoderLayer

#: int64 fields per layer in the table the C function reads (its ``DL_*`` enum, in order)
FIELDS = 13
#: the K-blocking field's value that marks a projection held in GGUF blocks (``DL_QUANTIZED``)
QUANTIZED = -1
#: ... and one on the AMX GEMM (``DL_AMX``: the field before it is the packed weight)
AMX = -2
#: the flag added to the K blocking of a projection whose weights are bfloat16 under float32
#: activations (``DL_W_BF16``, ``layers.bf16_weight_linear``)
W_BF16 = 1 << 40
#: ... and one held in int8 per output channel (``DL_INT8``: the field before it is the
#: address of ``Int8WeightLinear.table``)
INT8 = -3
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _bias(op: object) -> torch.Tensor | None:
    """The bias a projection adds after its product (``QuantizedLinear``, or a packed linear
    with radixserve's kernel, ``layers.linear.packed_linear``), or None."""
    return getattr(op, "bias", None)


def _fused_projection(op: object) -> str | None:
    """None where the C stack can run projection ``op``, else why not."""
    if isinstance(op, QuantizedLinear):
        if any(s.ggml_type is None for s in op.segments):
            return "a projection has rows of a GGUF type without a kernel (held dense)"
        return None
    if isinstance(op, Int8WeightLinear) and op.n_padded != op.n:
        return "an int8 projection's outputs are not a multiple of 64"
    if (isinstance(op, AmxLinear | Bf16WeightLinear | Int8WeightLinear)
            or isinstance(getattr(op, "kernel", None), PackedLinearKernel)):
        return None
    return "needs every projection on radixserve's linear kernels or GGUF blocks"


class DecodeStack:
    """The layer table and the call.

    Args:
        kernels: the loaded C kernels.
        layers: the model's ``DecoderLayer`` list, each projection packed with a
            ``PackedLinearKernel`` or held in GGUF blocks (``eligible`` says whether they are).
    """

    def __init__(self, kernels: CpuKernels, layers: list[DecoderLayer]) -> None:
        self.kernels = kernels
        self.layers = layers
        a = layers[0].a
        self.a = a
        self.scale = a.head_dim ** -0.5
        self.dtype: torch.dtype = layers[0].input_norm.dtype
        #: the most rows of a step the stack takes (the packed linear kernel's; the quantized
        #: kernels run every decode batch on the per-op path too)
        caps = [getattr(layer, n).kernel.max_rows for layer in layers for n in PROJECTIONS
                if not isinstance(getattr(layer, n),
                                  QuantizedLinear | AmxLinear | Bf16WeightLinear
                                  | Int8WeightLinear)]
        self.max_rows = min(caps) if caps else 1 << 30
        #: [L, FIELDS] int64, built for one set of KV tensors (``_table``)
        self._table: np.ndarray | None = None
        self._kv_key: tuple[int, ...] = ()
        #: the quantized projections' segment tables the layer table points to, kept alive
        self._segments: list[np.ndarray] = []

    @staticmethod
    def eligible(layers: list[DecoderLayer], kernels: CpuKernels | None,
                 sharded: bool) -> str | None:
        """None where the fused stack can run this model, else why not (for the start-up
        log and ``forward_path_info``)."""
        if kernels is None:
            return "needs the C kernels"
        if sharded:
            return "tensor parallel: the layers all-reduce between ops"
        for layer in layers:
            if layer.q_norm is not None:
                return "Q/K norm is not in the fused layer"
            if layer.qkv_bias is not None and _bias(layer.qkv_proj) is None:
                return "the QKV projection holds its bias inside oneDNN's GEMM"
            if not isinstance(layer.attn, CpuKernelPagedAttention):
                return "needs the 'cpu' attention backend"
            for name in PROJECTIONS:
                why = _fused_projection(getattr(layer, name))
                if why is not None:
                    return why
        return None

    def applies(self, h: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step is one the stack runs: decodes only, at most ``max_rows``."""
        t = h.shape[0]
        return (meta.num_decodes == t and not meta.prefill and 0 < t <= self.max_rows
                and h.dtype == self.dtype)

    def _table_for(self, kv_layers: list[torch.Tensor]) -> np.ndarray:
        key = tuple(kv.data_ptr() for kv in kv_layers)
        if self._table is None or key != self._kv_key:
            rows = []
            self._segments = []
            for layer, kv in zip(self.layers, kv_layers, strict=True):
                if not kv.is_contiguous() or kv.dtype != self.dtype:
                    raise ValueError(f"fused decode needs contiguous {self.dtype} KV tensors")
                projections = [v for n in PROJECTIONS for v in self._projection(getattr(layer, n))]
                bias = _bias(layer.qkv_proj)
                if bias is not None and (bias.dtype != self.dtype or not bias.is_contiguous()):
                    raise ValueError(f"fused decode needs a contiguous {self.dtype} QKV bias")
                rows.append([layer.input_norm.data_ptr(), layer.post_norm.data_ptr()]
                            + projections + [kv[0].data_ptr(), kv[1].data_ptr(),
                                             0 if bias is None else bias.data_ptr()])
            self._table = np.asarray(rows, dtype=np.int64)
            assert self._table.shape[1] == FIELDS
            self._kv_key = key
        return self._table

    def _projection(self, op: object) -> tuple[int, int]:
        """The two table fields of one projection: (packed weight, K blocking), or (its
        segment table's address, ``QUANTIZED``) for GGUF blocks."""
        if isinstance(op, QuantizedLinear):
            seg = np.asarray([len(op.segments)] + [v for s in op.segments for v in (
                s.kernel_type, s.data.data_ptr(), s.lo, s.hi)], dtype=np.int64)
            self._segments.append(seg)
            return seg.ctypes.data, QUANTIZED
        if isinstance(op, AmxLinear):
            return op.ptr, AMX
        if isinstance(op, Bf16WeightLinear):
            return op.ptr, op.k_block | W_BF16
        if isinstance(op, Int8WeightLinear):
            return int(op.table.ctypes.data), INT8
        kernel = op.kernel  # type: ignore[attr-defined]
        return kernel.ptr, kernel.k_block

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_layers: list[torch.Tensor], meta: AttentionMetadata
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers of a decode step (``applies``): h [B, hidden] embeddings,
        overwritten -> (the last layer's output, which is ``h``, and the residual stream), both
        [B, hidden], as the per-op loop in ``CausalLM.forward`` returns them.

        Args:
            cos, sin: [B, head_dim // 2], h's dtype.
            kv_layers: per layer [2, num_pages, page_size, Hkv, D], h's dtype.
            meta: the step's metadata (``slot_mapping``, ``decode_page_table``,
                ``decode_seq_lens``).

        Raises:
            ValueError: a tensor of the wrong dtype, shape or layout.
            RuntimeError: a kernel's error code (2: a length outside the page table, 4: a page
                id or slot outside the pool, 3: out of memory).
        """
        a = self.a
        b = h.shape[0]
        pt, lens, slots = meta.decode_page_table, meta.decode_seq_lens, meta.slot_mapping
        half = a.head_dim // 2
        if (pt is None or lens is None or pt.dtype != torch.int64 or pt.stride(1) != 1
                or pt.shape[0] != b or lens.dtype != torch.int64 or lens.shape != (b,)
                or not lens.is_contiguous() or slots.dtype != torch.int64
                or slots.shape != (b,) or not slots.is_contiguous()
                or not h.is_contiguous() or cos.shape != (b, half) or sin.shape != (b, half)
                or cos.dtype != self.dtype or sin.dtype != self.dtype
                or not cos.is_contiguous() or not sin.is_contiguous()):
            raise ValueError("fused decode: metadata or activations of the wrong layout")
        table = self._table_for(kv_layers)
        kv0 = kv_layers[0]
        num_pages, page_size = kv0.shape[1], kv0.shape[2]
        residual = torch.empty_like(h)
        rc = self.kernels.decode_layers(
            0 if self.dtype == torch.float32 else 1, table.ctypes.data, table.shape[0], h.data_ptr(), residual.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), pt.data_ptr(), pt.stride(0),
            pt.shape[1], num_pages, lens.data_ptr(), b, a.hidden_size, a.intermediate_size,
            a.num_heads, a.num_kv_heads, a.head_dim, page_size, a.rms_norm_eps, self.scale,
            torch.get_num_threads())
        if rc:
            raise RuntimeError(f"fused decode layers failed with code {rc}")
        return h, residual
