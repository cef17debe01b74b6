"""Rows through a oneDNN-packed bfloat16 linear with radixserve's kernel, bit for bit what
oneDNN's GEMM gives each row in any batch.

Why: a decode step's linears stream all the weights from DRAM. oneDNN runs one row through a
matrix-vector path that reads them at ~30 GB/s on a 2-core Zen 5 and whose sums differ from its
GEMM's (so ``batch_invariant`` sends two equal rows through the GEMM instead, at the same
speed), and at decode batch sizes its GEMM stalls on each weight block it streams in (~680
GFLOP/s over SmolLM2's 30 layers at 64 rows, ~930 with 256 rows). The C kernel
(``rs_linear_bf16_packed``) reads oneDNN's own packed buffer, no second copy of the weights: one
row as a GEMV streaming at ~57-63 GB/s, 2 to ``MAX_ROWS`` rows as a register-tiled GEMM that
prefetches the next weight block while it computes (~860 GFLOP/s at 64 rows; measured on that
VM, L3 32 MiB, weights 212 MB; docs/benchmarks.md sessions 9 and 10). Above ``MAX_ROWS`` (long
prefill chunks) oneDNN's GEMM runs, with the same bits.

It must reproduce the GEMM's arithmetic, which oneDNN does not document: each output sums its
k pairs in order with ``vdpbf16ps``, restarted every ``kblk`` elements of K, the blocks added in
order. ``kblk`` depends on the shape (measured on Zen 5: 512 for K = 576, 1024 for K = 1536), so
``find_k_block`` measures it per shape against oneDNN itself at load and the kernel is used
only where exactly one candidate reproduces oneDNN on every probe row; anywhere else (another
packed layout, a bias, float32, no AVX512-BF16) oneDNN stays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from radixserve.model_executor.kernels.cpu import CpuKernels

log = logging.getLogger(__name__)

#: outputs per block of oneDNN's packed bfloat16 layout ([N/64][K/2][64][2]) the kernel reads
BLOCK_N = 64
#: the most rows per call the kernel takes: at 2-512 rows it measured at or above oneDNN's GEMM
#: on every SmolLM2 shape (Zen 5 bf16, docs/benchmarks.md session 10); longer prefill chunks,
#: where oneDNN's blocking over M can only gain, stay with oneDNN (same bits either way)
MAX_ROWS = 512
#: probe rows of ``find_k_block`` and the outputs compared per row (the first blocks only:
#: blocks are independent, and a large LM head would make the probe slow)
PROBE_ROWS = 256
PROBE_OUTPUTS = 1024


@dataclass
class PackedBf16Linear:
    """radixserve's kernel over one packed weight, for 1 to ``max_rows`` rows.

    Attributes:
        kernels: the loaded C kernels.
        packed: oneDNN's packed bf16 weight (an opaque ``torch._mkldnn`` tensor) of logical
            shape [N, K]; kept alive here, its buffer is read in place.
        n, k: output and input features.
        k_block: oneDNN's K blocking for this shape (``find_k_block``).
        max_rows: calls with more rows go to oneDNN (``packed_linear``).
    """

    kernels: CpuKernels
    packed: torch.Tensor
    n: int
    k: int
    k_block: int
    max_rows: int = MAX_ROWS
    #: the packed buffer's address (it never moves: read once, not per call)
    ptr: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.ptr = torch.ops.mkldnn.data_ptr(self.packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x bfloat16 [M, K] (contiguous, 1 <= M <= max_rows) -> bfloat16 [M, N].

        Raises:
            ValueError: x is not a contiguous bfloat16 [M, K] with M in range.
        """
        m = x.shape[0]
        if (x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.k
                or not 1 <= m <= self.max_rows or not x.is_contiguous()):
            raise ValueError(f"packed bf16 linear needs contiguous bfloat16 [1..{self.max_rows}, "
                             f"{self.k}], got {x.dtype} {tuple(x.shape)}")
        out = torch.empty(m, self.n, dtype=torch.bfloat16)
        self.kernels.linear_bf16_packed_unchecked(x.data_ptr(), self.ptr, out.data_ptr(),
                                                  m, self.n, self.k, self.k_block)
        return out


def layout_matches(packed: torch.Tensor, n: int, k: int) -> bool:
    """Whether ``packed`` can be oneDNN's [N/64][K/2][64][2] bf16 layout: bf16, N a multiple
    of 64, K even, and exactly N * K * 2 bytes (any other blocking pads or reorders; the probe
    then confirms the element order)."""
    return (packed.dtype == torch.bfloat16 and n % BLOCK_N == 0 and k % 2 == 0
            and torch.ops.mkldnn._nbytes(packed) == n * k * 2)


def _candidates(k: int) -> list[int]:
    """K blockings tried: none (one block of K), then 32, 64, ... below K."""
    out, b = [k], 32
    while b < k:
        out.append(b)
        b *= 2
    return out


def find_k_block(kernels: CpuKernels, n: int, k: int, batch_hint: int,
                 seed: int = 0) -> int | None:
    """oneDNN's K blocking for a bf16 [N, K] weight packed with ``batch_hint``, found by
    probing, or None where no candidate (or more than one) reproduces oneDNN exactly.

    A random weight of the shape is packed as the model's are (oneDNN picks its kernel by
    shape, not values), ``PROBE_ROWS`` random rows go through oneDNN's GEMM in one call, and
    each candidate of ``_candidates`` runs the first ``PROBE_OUTPUTS`` outputs of every row
    through the kernel, one row at a time (the GEMV) and all rows at once (the GEMM); the
    blocking is the one candidate with no differing bit. Wrong blockings differ in a few
    outputs per ten thousand (rounding order only), hence the many rows. Costs one oneDNN GEMM
    of PROBE_ROWS rows and a few ms of ours per shape.
    """
    mkldnn = torch.ops.mkldnn
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    packed = mkldnn._reorder_linear_weight(w, batch_hint)
    if not layout_matches(packed, n, k):
        return None
    x = torch.randn(PROBE_ROWS, k, generator=g).to(torch.bfloat16)
    want = mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    cols = min(n, PROBE_OUTPUTS)
    want = want[:, :cols]
    got = torch.empty(PROBE_ROWS, cols, dtype=torch.bfloat16)
    ptr = mkldnn.data_ptr(packed)
    exact = []
    for kb in _candidates(k):
        kernels.linear_bf16_packed(x, ptr, got, kb)
        ok = torch.equal(got, want)
        for i in range(PROBE_ROWS if ok else 0):
            kernels.linear_bf16_packed(x[i:i + 1], ptr, got[i:i + 1], kb)
            if not torch.equal(got[i], want[i]):
                ok = False
                break
        if ok:
            exact.append(kb)
    if len(exact) != 1:
        log.info("packed bf16 linear for [%d, %d]: %s reproduce oneDNN's GEMM; keeping oneDNN",
                 n, k, exact or "no K blocking")
        return None
    return exact[0]


def packed_bf16_linear(kernels: CpuKernels | None, packed: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, batch_hint: int,
                       k_blocks: dict[tuple[int, int], int | None]) -> PackedBf16Linear | None:
    """radixserve's kernel for a weight oneDNN has just packed, or None where it cannot
    reproduce the GEMM (no kernels or no AVX512-BF16 in their build, not bf16, a bias, another
    layout, no unique K blocking) or disagrees with it on a row of the real weight.

    Args:
        kernels: the C kernels, or None.
        packed: ``mkldnn._reorder_linear_weight(weight, batch_hint)``.
        weight: the dense [N, K] weight (still allocated).
        bias: the layer's bias; the kernel has none.
        batch_hint: the hint ``packed`` was made with.
        k_blocks: per-(N, K) results of ``find_k_block``, shared across a model's layers.
    """
    n, k = weight.shape
    if (kernels is None or not kernels.has_bf16_dot or bias is not None
            or weight.dtype != torch.bfloat16 or not layout_matches(packed, n, k)):
        return None
    if (n, k) not in k_blocks:
        k_blocks[(n, k)] = find_k_block(kernels, n, k, batch_hint)
    kb = k_blocks[(n, k)]
    if kb is None:
        return None
    op = PackedBf16Linear(kernels, packed, n, k, kb)
    # the real weight: a few rows, alone and together, must agree with oneDNN to the bit
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if (not torch.equal(op(x), want)
            or any(not torch.equal(op(x[i:i + 1])[0], want[i]) for i in range(4))):
        log.warning("packed bf16 linear disagrees with oneDNN on a [%d, %d] weight; keeping "
                    "oneDNN", n, k)
        return None
    return op
