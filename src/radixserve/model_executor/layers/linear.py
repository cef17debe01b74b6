"""Linear projections ``y = x @ W.T + b`` as callables: dense (``F.linear``) or, on CPU, with
weights packed once into oneDNN's blocked layout.

Why pack: with plain row-major weights, MKL's sgemm runs decode-sized batches (M = 4-64 tokens)
at roughly half its large-M throughput; oneDNN's matmul over pre-packed weights keeps it up
(measured on a 2-core Zen 3 in float32: the 30 SmolLM2 layers at M = 16 in 41 ms instead of
58 ms, the LM head at M = 4 in 5 ms instead of 19 ms) for a few % less at prefill-sized M. vLLM's
CPU backend packs its linear weights for oneDNN for the same reason
(``dispatch_cpu_unquantized_gemm`` → ``create_onednn_mm``). The ops used are the ones torch's
own Inductor emits for CPU linears (``mkldnn._reorder_linear_weight``/``_linear_pointwise``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

LinearFn = Callable[[torch.Tensor], torch.Tensor]

#: dtypes oneDNN packs on CPU
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def batch_invariant(fn: LinearFn) -> LinearFn:
    """``fn`` with a single-row input computed as two equal rows, so that a row's result never
    depends on how many rows share the call.

    Why: oneDNN and MKL run M = 1 through a matrix-vector kernel whose reduction order over K
    differs from their GEMM kernels, which agree with each other for every M >= 2 (measured in
    bfloat16 on the default model's activations, Zen 5, packed and dense: SmolLM2's ``down``
    projection, K = 1536, gave a different bf16 result for 1 row in 3 calls at M = 1 and
    none for M = 2..950). A request decoding alone then drifts from the same request in a
    batch; with this, 24 prompts give the same greedy tokens alone and together. The second
    row costs little at M = 1: the call is bound by reading the weights.
    """

    def call(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return fn(x.expand(2, -1).contiguous())[:1]
        return fn(x)

    return call


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearFn:
    """``x [M, K] -> [M, N]`` with ``weight [N, K]`` as stored (any device); row results do
    not depend on M (see ``batch_invariant``). A weight held in another dtype than x (bf16
    weights under float32 activations, ``layers.bf16_weight_linear``) is widened per call:
    the reference path's cost, exact."""
    def call(x: torch.Tensor) -> torch.Tensor:
        w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        return F.linear(x, w, bias)

    return batch_invariant(call)


#: builds radixserve's kernel path of a packed weight: (packed, weight, bias) -> a callable
#: ``[M, K] -> [M, N]`` for ``1 <= M <= .max_rows``, bit-identical to the packed GEMM's rows,
#: or None (``packed_kernel``)
KernelFactory = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None],
                         LinearFn | None]


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, batch_hint: int,
                  kernel: KernelFactory | None = None) -> LinearFn | None:
    """``x [M, K] -> [M, N]`` with ``weight [N, K]`` packed for oneDNN; None where torch lacks
    the ops, the tensor is not a CPU float32/bfloat16 one, or the packed result disagrees with
    ``F.linear`` on a probe row.

    Args:
        weight: [N, K] on CPU. Not modified; the caller may free it after packing.
        bias: [N] or None.
        batch_hint: the M the packed layout is tuned for (tokens per call, typically the decode
            batch); any M works.
        kernel: where given and it returns a path, calls of up to its ``max_rows`` rows take it
            (one row then no longer goes as two equal rows through the GEMM,
            ``batch_invariant``); it must give the GEMM's bits.

    A bias is added after the GEMM (``y += bias``, rounded to the dtype as torch rounds it),
    never inside it: radixserve's kernel reproduces oneDNN's bias-free GEMM, the fused decode
    stack repeats the same add, and a row must get the same bits on every path, the one without
    the kernel (``cpu_linear_kernel=False``) included.
    """
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
        return None
    if bias is not None:
        inner = packed_linear(weight, None, batch_hint, kernel)
        if inner is None:
            return None

        def biased(x: torch.Tensor) -> torch.Tensor:
            y = inner(x)
            y += bias
            return y

        biased.bias = bias  # type: ignore[attr-defined] - for the fused decode stack
        if hasattr(inner, "kernel"):
            biased.kernel = inner.kernel  # type: ignore[attr-defined]
        return biased
    try:
        mkldnn = torch.ops.mkldnn
        packed = mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        probe = torch.ones(1, weight.shape[1], dtype=weight.dtype)
        got = mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
    except (AttributeError, RuntimeError) as e:
        log.info("oneDNN weight packing unavailable (%s): dense linears", e)
        return None
    want = F.linear(probe, weight, bias)
    tol = 1e-3 if weight.dtype == torch.float32 else 5e-2
    if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol):
        log.warning("oneDNN packed linear disagrees with F.linear: dense linears")
        return None
    op = mkldnn._linear_pointwise
    gemm = batch_invariant(lambda x: op(x, packed, bias, "none", [], ""))
    own = kernel(packed, weight, bias) if kernel is not None else None
    if own is None:
        return gemm
    max_rows = own.max_rows  # type: ignore[attr-defined]

    def call(x: torch.Tensor) -> torch.Tensor:
        return own(x.contiguous()) if x.shape[0] <= max_rows else gemm(x)

    call.kernel = own  # type: ignore[attr-defined] - for tests
    return call
