"""Rows through a oneDNN-packed linear with radixserve's kernel, bit for bit what oneDNN's GEMM
gives each row in any batch (bfloat16 and float32).

Why: a decode step's linears stream all the weights from DRAM. oneDNN runs one row through a
matrix-vector path whose sums differ from its GEMM's (so ``batch_invariant`` sends two equal
rows through the GEMM instead), and at decode batch sizes its GEMM stalls on each weight block
it streams in. The C kernels (``rs_linear_bf16_packed``, ``rs_linear_f32_packed``) read
oneDNN's own packed buffer, no second copy of the weights, tile rows x 64 outputs in registers
and prefetch each thread's next weight block while they compute (bf16: a GEMV for one row).
Over SmolLM2's 30 layers on the Zen 5 VM (CHANGELOG.md, 2026-11-24): bf16 at 64 rows 19.8
→ 15.2 ms, float32 at 64 rows 36.7 → 30.2 ms, float32 with oneDNN and the kernel both held to
AVX2 63.1 → 60.3 ms. Above ``max_rows`` (long prefill chunks) oneDNN's GEMM runs, with the
same bits: it ties or wins there.

It must reproduce the GEMM's arithmetic, which oneDNN does not document: each output sums its
k (bf16: k pairs, ``vdpbf16ps``; float32: one FMA each) in order, restarted every ``kblk``
elements of K, the blocks added in order. ``kblk`` depends on the shape and the ISA (measured
on Zen 5: bf16 and float32 512 for K = 576, 1024 for K = 1536; capped at AVX2: 576 and 1024),
so ``find_k_block`` measures it per shape against oneDNN itself at load and the kernel is used
only where exactly one candidate reproduces oneDNN on every probe row; anywhere else (another
packed layout, a bias, a CPU without the instructions) oneDNN stays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from radixserve.model_executor.kernels.cpu import CpuKernels

log = logging.getLogger(__name__)

#: outputs per block of oneDNN's packed layouts the kernels read (bf16 [N/64][K/2][64][2],
#: float32 [N/64][K][64])
BLOCK_N = 64
#: the most rows per call the kernel takes where the engine has not measured it
#: (``path_choice.choose_kernel_rows`` does at start-up), per dtype and float32 build: up to
#: these it measured at or above oneDNN's GEMM on every SmolLM2 shape (Zen 5; the AVX2 build
#: against oneDNN capped at AVX2; CHANGELOG.md, 2026-11-24); longer calls stay with
#: oneDNN (same bits either way)
MAX_ROWS = 512
MAX_ROWS_F32_AVX2 = 64
#: probe rows of ``find_k_block`` and the outputs compared per row (the first blocks only:
#: blocks are independent, and a large LM head would make the probe slow)
PROBE_ROWS = 256
PROBE_OUTPUTS = 1024


def max_rows_for(kernels: CpuKernels, dtype: torch.dtype) -> int:
    """Rows per call up to which the kernel runs for ``dtype`` on this build."""
    return MAX_ROWS_F32_AVX2 if (dtype == torch.float32
                                 and kernels.f32_gemm_isa == "avx2") else MAX_ROWS


@dataclass
class PackedLinearKernel:
    """radixserve's kernel over one packed weight, for 1 to ``max_rows`` rows.

    Attributes:
        kernels: the loaded C kernels.
        packed: oneDNN's packed weight (an opaque ``torch._mkldnn`` tensor) of logical
            shape [N, K]; kept alive here, its buffer is read in place.
        n, k: output and input features.
        dtype: the weight's (and activations') dtype, bfloat16 or float32.
        k_block: oneDNN's K blocking for this shape (``find_k_block``).
        max_rows: calls with more rows go to oneDNN (``packed_linear``).
    """

    kernels: CpuKernels
    packed: torch.Tensor
    n: int
    k: int
    dtype: torch.dtype
    k_block: int
    max_rows: int = MAX_ROWS
    #: the packed buffer's address (it never moves: read once, not per call)
    ptr: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.ptr = torch.ops.mkldnn.data_ptr(self.packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] of ``dtype`` (contiguous, 1 <= M <= max_rows) -> [M, N].

        Raises:
            ValueError: x is not a contiguous [M, K] of ``dtype`` with M in range.
        """
        m = x.shape[0]
        if (x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.k
                or not 1 <= m <= self.max_rows or not x.is_contiguous()):
            raise ValueError(f"packed linear kernel needs contiguous {self.dtype} "
                             f"[1..{self.max_rows}, {self.k}], got {x.dtype} {tuple(x.shape)}")
        out = torch.empty(m, self.n, dtype=self.dtype)
        self.kernels.linear_packed_unchecked(self.dtype, x.data_ptr(), self.ptr, out.data_ptr(),
                                             m, self.n, self.k, self.k_block)
        return out


def layout_matches(packed: torch.Tensor, n: int, k: int) -> bool:
    """Whether ``packed`` can be oneDNN's bf16 [N/64][K/2][64][2] (K even) or float32
    [N/64][K][64] layout: N a multiple of 64 and exactly N * K elements (any other blocking
    pads or reorders; the probe then confirms the element order)."""
    size = {torch.bfloat16: 2, torch.float32: 4}.get(packed.dtype)
    return (size is not None and n % BLOCK_N == 0
            and (k % 2 == 0 or packed.dtype == torch.float32)
            and torch.ops.mkldnn._nbytes(packed) == n * k * size)


def _candidates(k: int) -> list[int]:
    """K blockings tried: none (one block of K), then 32, 64, ... below K."""
    out, b = [k], 32
    while b < k:
        out.append(b)
        b *= 2
    return out


def find_k_block(kernels: CpuKernels, n: int, k: int, batch_hint: int,
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 packed: torch.Tensor | None = None) -> int | None:
    """oneDNN's K blocking for a [N, K] weight of ``dtype`` packed with ``batch_hint``, found
    by probing, or None where no candidate (or more than one) reproduces oneDNN exactly.

    A random weight of the shape is packed as the model's are (oneDNN picks its kernel by
    shape, not values), ``PROBE_ROWS`` random rows go through oneDNN's GEMM in one call, and
    each candidate of ``_candidates`` runs the first ``PROBE_OUTPUTS`` outputs of every row
    through the kernel, one row at a time (the GEMV) and all rows at once (the GEMM); the
    blocking is the one candidate with no differing bit. Wrong blockings differ in a few
    outputs per ten thousand (rounding order only), hence the many rows. Costs one oneDNN GEMM
    of PROBE_ROWS rows and a few ms of ours per shape.

    Args:
        packed: a real weight of the shape already packed with ``batch_hint`` (the model's
            own): probed in place of a random one, so that no second copy of a large weight
            (a 152k-row LM head: 2 GB in float32) is made at load.
    """
    mkldnn = torch.ops.mkldnn
    g = torch.Generator().manual_seed(seed)
    if packed is None:
        w = torch.randn(n, k, generator=g).to(dtype)
        packed = mkldnn._reorder_linear_weight(w, batch_hint)
        del w
    if not layout_matches(packed, n, k):
        return None
    x = torch.randn(PROBE_ROWS, k, generator=g).to(dtype)
    want = mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    cols = min(n, PROBE_OUTPUTS)
    want = want[:, :cols]
    got = torch.empty(PROBE_ROWS, cols, dtype=dtype)
    ptr = mkldnn.data_ptr(packed)
    exact = []
    for kb in _candidates(k):
        kernels.linear_packed(x, ptr, got, kb)
        ok = torch.equal(got, want)
        for i in range(PROBE_ROWS if ok else 0):
            kernels.linear_packed(x[i:i + 1], ptr, got[i:i + 1], kb)
            if not torch.equal(got[i], want[i]):
                ok = False
                break
        if ok:
            exact.append(kb)
    if len(exact) != 1:
        log.info("packed linear kernel for %s [%d, %d]: %s reproduce oneDNN's GEMM; keeping "
                 "oneDNN", dtype, n, k, exact or "no K blocking")
        return None
    return exact[0]


def packed_kernel_linear(kernels: CpuKernels | None, packed: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None, batch_hint: int,
                         k_blocks: dict[tuple[int, int], int | None],
                         max_rows: int | None = None) -> PackedLinearKernel | None:
    """radixserve's kernel for a weight oneDNN has just packed, or None where it cannot
    reproduce the GEMM (no kernels or no kernel for the dtype in their build, a bias, another
    layout, no unique K blocking) or disagrees with it on a row of the real weight.

    Args:
        kernels: the C kernels, or None.
        packed: ``mkldnn._reorder_linear_weight(weight, batch_hint)``.
        weight: the dense [N, K] weight (still allocated), bfloat16 or float32.
        bias: the layer's bias; the kernel has none.
        batch_hint: the hint ``packed`` was made with.
        k_blocks: per-(N, K) results of ``find_k_block``, shared across a model's layers
            (one dtype per model).
        max_rows: the most rows per call the kernel takes (measured on the machine,
            ``path_choice.choose_kernel_rows``); None: ``max_rows_for``'s rule.
    """
    n, k = weight.shape
    dt = weight.dtype
    if (kernels is None or not kernels.has_linear_kernel(dt) or bias is not None
            or not layout_matches(packed, n, k)):
        return None
    if (n, k) not in k_blocks:
        k_blocks[(n, k)] = find_k_block(kernels, n, k, batch_hint, dt, packed=packed)
    kb = k_blocks[(n, k)]
    if kb is None:
        return None
    op = PackedLinearKernel(kernels, packed, n, k, dt, kb,
                            max_rows_for(kernels, dt) if max_rows is None else max_rows)
    # the real weight: a few rows, alone and together, must agree with oneDNN to the bit
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(1)).to(dt)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if (not torch.equal(op(x), want)
            or any(not torch.equal(op(x[i:i + 1])[0], want[i]) for i in range(4))):
        log.warning("packed linear kernel disagrees with oneDNN on a %s [%d, %d] weight; "
                    "keeping oneDNN", dt, n, k)
        return None
    return op
