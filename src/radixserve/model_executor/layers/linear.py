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


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearFn:
    """``x [M, K] -> [M, N]`` with ``weight [N, K]`` as stored (any device)."""
    return lambda x: F.linear(x, weight, bias)


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None,
                  batch_hint: int) -> LinearFn | None:
    """``x [M, K] -> [M, N]`` with ``weight [N, K]`` packed for oneDNN; None where torch lacks
    the ops, the tensor is not a CPU float32/bfloat16 one, or the packed result disagrees with
    ``F.linear`` on a probe row.

    Args:
        weight: [N, K] on CPU. Not modified; the caller may free it after packing.
        bias: [N] or None.
        batch_hint: the M the packed layout is tuned for (tokens per call, typically the decode
            batch); any M works.
    """
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
        return None
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
    return lambda x: op(x, packed, bias, "none", [], "")
