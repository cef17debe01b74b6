"""Shadow checks of the fast paths (the seeds' shadow mode): a sampled fraction of steps is run
again on the reference path, on the same inputs, and the two results are compared. Nothing is
ever served from the reference: it only counts agreements and divergences for ``/metrics``.

The reference is a copy of the model taken before its linears are packed: torch SDPA attention
over gathered pages (``SdpaPagedAttention``), dense ``F.linear`` projections and torch's RMSNorm,
eager. It costs a second copy of the weights, so it exists only with ``--shadow-rate`` > 0.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

import torch

from radixserve.engine_types import ShadowStats
from radixserve.model_executor.attention.paged_attention import (
    AttentionMetadata,
    SdpaPagedAttention,
)
from radixserve.model_executor.models.llama import CausalLM


def reference_copy(model: CausalLM) -> CausalLM:
    """A deep copy of ``model`` (call before ``pack_linears``) that runs every op on the
    reference path: SDPA attention, dense linears, torch RMSNorm. Weights are copied (the
    reference must survive the packing that frees the fast model's dense weights); quantized
    ones (GGUF blocks, int8) are dequantized into dense float weights of the serving dtype, so
    the reference computes the served model's own weights with float arithmetic (the copy
    then takes 2-8x the quantized model's memory)."""
    # the kernel library (ctypes), the kernel attention objects and the quantized methods are
    # not copied: the copy gets None in their place, SDPA attention and dense weights below
    memo: dict[int, object] = {id(model.kernels): None, id(model.ops): None,
                               id(model.quant): None, id(model.embed_q): None,
                               id(model.lm_head_q): None}
    for layer in model.layers:
        memo[id(layer.attn)] = None
        for method in layer.quantized.values():
            memo[id(method)] = None
    ref = copy.deepcopy(model, memo)
    ref.kernels = ref.ops = ref.quant = None
    ref.quantization = None
    ref._lm_head_proj = None
    ref._logits_buf = None  # its own, never the fast model's
    dtype = model.norm.dtype
    with torch.no_grad():
        if model.embed_q is not None:
            ref.embed.data = model.embed_q.weight().to(dtype)
        ref.embed_q = None
        if model.lm_head_q is not None:
            ref.lm_head = torch.nn.Parameter(model.lm_head_q.weight().to(dtype),
                                             requires_grad=False)
        ref.lm_head_q = None
        for layer, src in zip(ref.layers, model.layers, strict=True):
            a = layer.a
            layer.kernels = layer.ops = None
            layer.attn = SdpaPagedAttention(a.num_heads, a.num_kv_heads, a.head_dim,
                                            a.head_dim ** -0.5)
            for name, method in src.quantized.items():
                layer.get_parameter(name).data = method.weight().to(dtype)
            layer.quantized = {}
            layer.bind_dense_linears()
    return ref


class ShadowChecker:
    """Re-runs a sampled fraction of steps on the reference model and compares.

    Per checked step it compares, for every row that gets logits, the greedy token (argmax) of
    the fast path's float32 logits [S, vocab] with the reference's, and records the largest
    absolute logit difference. The step's K/V slots are written again by the reference forward,
    so the fast path's values are saved first and put back after: the pool stays exactly what
    the served path wrote.

    Args:
        reference: the model from ``reference_copy``.
        rate: fraction of steps checked, in [0, 1].
        seed: seed of the step sampler (the choice of steps is reproducible).
    """

    def __init__(self, reference: CausalLM, rate: float, seed: int) -> None:
        self.reference = reference
        self.rate = rate
        self._rng = random.Random(seed)
        self.stats = ShadowStats()

    def wants_step(self) -> bool:
        return self.rate >= 1.0 or self._rng.random() < self.rate

    def check(self, ids: torch.Tensor, pos: torch.Tensor, kv_layers: list[torch.Tensor],
              meta: Callable[[], AttentionMetadata], logits_rows: torch.Tensor,
              fast_logits: torch.Tensor) -> None:
        """Run the reference on the step's inputs and count the comparison.

        Args:
            ids, pos: int64 [T] the step's tokens and positions.
            kv_layers: the pool's per-layer [2, num_pages, page, Hkv, D] tensors.
            meta: builds the step's attention metadata for the SDPA path (with decode masks).
            logits_rows: int64 [S] rows of the hidden states that get logits.
            fast_logits: float32 [S, vocab], what the fast path computed.
        """
        saved: list[torch.Tensor] = []
        m = meta()
        slots = m.slot_mapping
        for kv in kv_layers:
            flat = kv.view(2, -1, *kv.shape[3:])
            saved.append(flat.index_select(1, slots))
        try:
            hidden = self.reference(ids, pos, kv_layers, m)
            ref_logits = self.reference.compute_logits(hidden[logits_rows])
        finally:
            for kv, old in zip(kv_layers, saved, strict=True):
                kv.view(2, -1, *kv.shape[3:]).index_copy_(1, slots, old)
        diff = float((fast_logits - ref_logits).abs().max()) if fast_logits.numel() else 0.0
        same = int((fast_logits.argmax(-1) == ref_logits.argmax(-1)).sum())
        s = self.stats
        s.steps += 1
        s.tokens_agree += same
        s.tokens_diverge += int(fast_logits.shape[0]) - same
        s.max_abs_logit_diff = max(s.max_abs_logit_diff, diff)
        s.last_abs_logit_diff = diff
