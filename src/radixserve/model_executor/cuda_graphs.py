"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured at start-up
over static input buffers, so a decode step costs one graph launch instead of a few hundred
kernel launches from Python (the CPU time per step that the seeds want hidden under the GPU's).

What is captured: the whole forward of a decode-only step and the LM head, for B padded up to
the smallest bucket >= B. Prefill and mixed steps, steps with prompt logprobs and batches larger
than the largest bucket run eagerly. The sampler stays outside the graph: its work depends on
each row's parameters (temperature, top-k/p, penalties, grammar masks, per-request generators)
and, for greedy rows, is one argmax over [B, vocab] logits.

Padding rows are harmless by construction: token 0 at position 0, KV written to slot 0 of the
null page (page 0, which no request owns), a page table of null pages and a context of one key.
Their logits are sliced off.

The same buffers and padding run eagerly with ``capture=False`` (CPU), which is how the padding
logic is tested where no GPU is at hand; the capture itself (``torch.cuda.graph``) needs CUDA.
Source of the technique: vLLM's ``CUDAGraphRunner`` / SGLang's ``CudaGraphRunner`` (capture per
batch-size bucket, shared memory pool, largest bucket first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from radixserve.model_executor.attention.paged_attention import AttentionMetadata
from radixserve.model_executor.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

#: Batch sizes captured by default (SGLang's and vLLM's are similar: small sizes densely, then
#: every 16 / 32), cut at ``max_bs``.
DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224,
                   256, 320, 384, 448, 512)


def graph_buckets(max_bs: int) -> list[int]:
    """The buckets up to ``max_bs`` (``max_bs`` itself included as the last).

    Raises:
        ValueError: ``max_bs`` < 1.
    """
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs={max_bs} must be >= 1")
    out = [b for b in DEFAULT_BUCKETS if b < max_bs]
    return [*out, max_bs]


class DecodeGraphs:
    """Decode-only steps run from per-bucket graphs over static buffers.

    Args:
        model: the ``CausalLM`` (weights on ``device``).
        kv_layers: its per-layer KV tensors ``[2, num_pages, page_size, Hkv, D]``.
        page_size: tokens per page.
        max_pages: page-table width captured (pages of the longest sequence).
        buckets: batch sizes to capture (``graph_buckets``).
        backend: the model's attention backend ("torch" builds its key mask inside the graph,
            "triton" / "cpu" read the page table and lengths).
        capture: True records CUDA graphs (CUDA only); False runs the same padded buffers
            eagerly (tests of the padding on CPU).

    Raises:
        RuntimeError: capture failed (an op in the forward is not capturable).
    """

    def __init__(self, model: Any, kv_layers: list[torch.Tensor], page_size: int,
                 max_pages: int, buckets: list[int], backend: str, capture: bool) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.page_size = page_size
        self.max_pages = max_pages
        self.buckets = sorted(buckets)
        self.backend = backend
        self.capture = capture
        dev = kv_layers[0].device
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self.page_table = torch.zeros(n, max_pages, dtype=torch.int64, device=dev)
        # the C kernel reads lengths on the host; the others on the device
        lens_dev = torch.device("cpu") if backend == "cpu" else dev
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=lens_dev)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    # ------------------------------------------------------------------ the captured step
    def _forward(self, b: int) -> torch.Tensor:
        """The step over the first ``b`` static rows: float32 logits [b, vocab]."""
        lens = self.seq_lens[:b]
        mask = None
        if self.backend == "torch":
            keys = torch.arange(self.max_pages * self.page_size, device=lens.device)
            mask = (keys[None, :] < lens[:, None])[:, None, None, :]
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:b], num_decodes=b,
                                 decode_page_table=self.page_table[:b], decode_seq_lens=lens,
                                 decode_mask=mask, prefill=[])
        hidden = self.model(self.input_ids[:b], self.positions[:b], self.kv_layers, meta)
        return self.model.compute_logits(hidden)

    def _capture_all(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool."""
        pool = None
        stream = torch.cuda.Stream()
        for b in reversed(self.buckets):
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: lazy inits and autotuning happen outside capture
                    self._forward(b)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                self.outputs[b] = self._forward(b)
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize()
        log.info("CUDA graphs captured for decode batch sizes %s", self.buckets)

    # ------------------------------------------------------------------ serving
    def can_run(self, batch: ForwardBatch) -> bool:
        """True for a decode-only step that fits a bucket and the captured page-table width
        and asks for no prompt logprobs."""
        b = batch.num_requests
        return (b > 0 and batch.num_decodes == b and b <= self.buckets[-1]
                and batch.prompt_logprobs is None
                and int(batch.seq_lens.max()) <= self.max_pages * self.page_size)

    def bucket(self, b: int) -> int:
        """The smallest captured batch size >= ``b``."""
        return next(x for x in self.buckets if x >= b)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Copy the step into the static buffers (padding rows to the bucket), replay, and
        return float32 logits [B, vocab] of its B rows (a view of the graph's output: read it
        before the next step)."""
        b = batch.num_requests
        n = self.bucket(b)
        pages = batch.page_table.shape[1]
        self._fill(self.input_ids, batch.input_ids, n, 0)
        self._fill(self.positions, batch.positions, n, 0)
        self._fill(self.slot_mapping, batch.slot_mapping, n, 0)
        self._fill(self.seq_lens, batch.seq_lens, n, 1)
        table = np.zeros((n, self.max_pages), dtype=np.int64)
        table[:b, :pages] = batch.page_table
        self.page_table[:n].copy_(torch.from_numpy(table), non_blocking=True)
        if self.capture:
            self.graphs[n].replay()
            return self.outputs[n][:b]
        return self._forward(n)[:b]

    @staticmethod
    def _fill(dst: torch.Tensor, src: np.ndarray, n: int, pad: int) -> None:
        """``dst[:n]`` = ``src`` then ``pad`` (a host-to-device copy of n values)."""
        host = np.full(n, pad, dtype=np.int64)
        host[:len(src)] = src
        dst[:n].copy_(torch.from_numpy(host), non_blocking=dst.device.type == "cuda")


def maybe_decode_graphs(model: Any, kv_layers: list[torch.Tensor], page_size: int,
                        max_model_len: int, max_bs: int, backend: str, enforce_eager: bool,
                        fallback: Callable[[str], None]) -> DecodeGraphs | None:
    """Decode graphs on CUDA unless ``enforce_eager``; None on CPU. A capture that fails is
    reported through ``fallback(reason)`` and the engine runs eagerly."""
    if enforce_eager or kv_layers[0].device.type != "cuda":
        return None
    try:
        return DecodeGraphs(model, kv_layers, page_size, -(-max_model_len // page_size),
                            graph_buckets(max_bs), backend, capture=True)
    except RuntimeError as e:
        fallback(f"CUDA graph capture failed: {e}")
        return None
