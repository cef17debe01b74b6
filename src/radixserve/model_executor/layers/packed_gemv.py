"""One row (a lone decode) through a oneDNN-packed bfloat16 linear with radixserve's GEMV
kernel, bit for bit what oneDNN's GEMM gives that row in a batch.

Why: a decode batch of one spends ~75% of its step streaming weights, and oneDNN runs a single
row through a matrix-vector path that reads them at ~30 GB/s on a 2-core Zen 5 (of the ~47 GB/s
a plain sum reads there), and whose sums differ from its GEMM's (so ``batch_invariant`` sends
two equal rows through the GEMM instead, at the same speed). The C kernel
(``rs_gemv_bf16_packed``) reads oneDNN's own packed buffer, no second copy of the weights, at
~57-63 GB/s over the 30 SmolLM2 layers (measured on that VM, L3 32 MiB, weights 212 MB).

It must reproduce the GEMM's arithmetic, which oneDNN does not document: each output sums its
k pairs in order with ``vdpbf16ps``, restarted every ``kblk`` elements of K, the blocks added in
order. ``kblk`` depends on the shape (measured on Zen 5: 512 for K = 576, 1024 for K = 1536), so
``find_k_block`` measures it per shape against oneDNN itself at load and the fast path is used
only where exactly one candidate reproduces oneDNN on every probe row; anywhere else (another
packed layout, a bias, float32, no AVX512-BF16) the two-row GEMM stays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from radixserve.model_executor.kernels.cpu import CpuKernels

log = logging.getLogger(__name__)

#: outputs per block of oneDNN's packed bfloat16 layout ([N/64][K/2][64][2]) the kernel reads
BLOCK_N = 64
#: probe rows of ``find_k_block`` and the outputs compared per row (the first blocks only:
#: blocks are independent, and a large LM head would make the probe slow)
PROBE_ROWS = 256
PROBE_OUTPUTS = 1024


@dataclass
class SingleRowGemv:
    """The GEMV for one packed weight.

    Attributes:
        kernels: the loaded C kernels.
        packed: oneDNN's packed bf16 weight (an opaque ``torch._mkldnn`` tensor) of logical
            shape [N, K]; kept alive here, its buffer is read in place.
        n, k: output and input features.
        k_block: oneDNN's K blocking for this shape (``find_k_block``).
    """

    kernels: CpuKernels
    packed: torch.Tensor
    n: int
    k: int
    k_block: int
    _ptr: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # the packed buffer never moves: its address once, not per call
        self._ptr = torch.ops.mkldnn.data_ptr(self.packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x bfloat16 [1, K] (contiguous) -> bfloat16 [1, N].

        Raises:
            ValueError: x is not a contiguous bfloat16 [1, K].
        """
        if x.dtype != torch.bfloat16 or x.shape != (1, self.k) or not x.is_contiguous():
            raise ValueError(f"single-row GEMV needs contiguous bfloat16 [1, {self.k}], got "
                             f"{x.dtype} {tuple(x.shape)}")
        out = torch.empty(1, self.n, dtype=torch.bfloat16)
        self.kernels.gemv_bf16_packed_unchecked(x.data_ptr(), self._ptr, out.data_ptr(),
                                                self.n, self.k, self.k_block)
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
    through the GEMV; the blocking is the one candidate with no differing bit. Wrong blockings
    differ in a few outputs per ten thousand (rounding order only), hence the many rows.
    Costs one GEMM of PROBE_ROWS rows and a few ms of GEMVs per shape.
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
    got = torch.empty(cols, dtype=torch.bfloat16)
    ptr = mkldnn.data_ptr(packed)
    exact = []
    for kb in _candidates(k):
        ok = True
        for i in range(PROBE_ROWS):
            kernels.gemv_bf16_packed(x[i:i + 1], ptr, got.view(1, cols), kb)
            if not torch.equal(got, want[i, :cols]):
                ok = False
                break
        if ok:
            exact.append(kb)
    if len(exact) != 1:
        log.info("single-row GEMV for [%d, %d]: %s reproduce oneDNN's GEMM; keeping the GEMM",
                 n, k, exact or "no K blocking")
        return None
    return exact[0]


def single_row_gemv(kernels: CpuKernels | None, packed: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None, batch_hint: int,
                    k_blocks: dict[tuple[int, int], int | None]) -> SingleRowGemv | None:
    """The GEMV for a weight oneDNN has just packed, or None where it cannot reproduce the
    GEMM (no kernels or no AVX512-BF16 in their build, not bf16, a bias, another layout, no
    unique K blocking) or disagrees with it on a row of the real weight.

    Args:
        kernels: the C kernels, or None.
        packed: ``mkldnn._reorder_linear_weight(weight, batch_hint)``.
        weight: the dense [N, K] weight (still allocated).
        bias: the layer's bias; the GEMV has none.
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
    gemv = SingleRowGemv(kernels, packed, n, k, kb)
    # the real weight: a few rows through both paths must agree to the bit
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if any(not torch.equal(gemv(x[i:i + 1])[0], want[i]) for i in range(4)):
        log.warning("single-row GEMV disagrees with oneDNN on a [%d, %d] weight; keeping the "
                    "GEMM", n, k)
        return None
    return gemv
