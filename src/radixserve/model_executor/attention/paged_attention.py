"""Paged attention over the KV pool: writes a step's K/V into its slots and attends over each
sequence's pages.

Three backends, picked once when the model is built:

* ``SdpaPagedAttention`` (``--attention-backend torch``, the reference; CPU and CUDA): decodes
  (one query token each) in one batched ``scaled_dot_product_attention`` call over their
  gathered pages, padded to the longest context and masked;
* ``CpuKernelPagedAttention`` (``--attention-backend cpu``): decodes through radixserve's C
  kernel (``kernels/cpu.py``: keys and values read in place from their pages);
* ``TritonPagedAttention`` (``--attention-backend triton``, ``triton_attention.py``): decodes
  and prefill chunks through radixserve's Triton kernels (CUDA; CPU only in Triton's
  interpreter, for tests).

The first two run prefill chunks one sequence at a time over its own pages (SDPA, or the C
prefill kernel), so no row's reduction depends on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.model_executor.kernels.cpu import CpuKernels


@dataclass
class AttentionMetadata:
    """Device tensors describing one step for attention.

    Attributes:
        slot_mapping: int64 [T] flat KV slot per new token.
        num_decodes: leading requests with one query token each (tokens [0, num_decodes)).
        decode_page_table: int64 [D, Pd] pages of the decodes (null page 0 as padding).
        decode_seq_lens: int64 [D] keys per decode (its context length, this token included).
        decode_mask: bool [D, 1, 1, Pd * page_size] True where a key position is valid (only
            for the SDPA path; None when the decode kernel runs).
        prefill: per prefill chunk (token start, token end, context length, int64 pages [p]).
        prefill_bounds: int64 [C, 3] the same chunks packed for the Triton extend kernel, per
            chunk (token start, token count, context length); None when the backend does not
            read it (the Triton backend then packs ``prefill`` itself).
        prefill_page_table: int64 [C, P] the chunks' pages (zero-padded), with
            ``prefill_bounds``.
        prefill_max_q_len: the largest chunk's token count, with ``prefill_bounds``.
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_page_table: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefill: list[tuple[int, int, int, torch.Tensor]]
    prefill_bounds: torch.Tensor | None = None
    prefill_page_table: torch.Tensor | None = None
    prefill_max_q_len: int = 0


def gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """Rows of ``pages`` from one of K or V, as one contiguous copy.

    Args:
        cache: contiguous [num_pages, page_size, Hkv, D].
        pages: int64 [n] page ids.
    Returns: [n * page_size, Hkv, D]. (``index_select`` on the flat [num_pages, -1] view copies
    whole pages; advanced indexing ``kv[:, pages]`` was ~3x slower on CPU.)
    """
    n, _, hkv, d = cache.shape
    return torch.index_select(cache.view(n, -1), 0, pages).view(-1, hkv, d)


class SdpaPagedAttention:
    """Writes this step's K/V into the pool and attends over each sequence's pages with
    torch's SDPA (decodes batched over gathered pages).

    Args:
        num_heads, num_kv_heads, head_dim: attention sizes (GQA when num_kv_heads < num_heads).
        scale: softmax scale.
    """

    #: the value of ``ModelRunner.attention_backend`` for this class
    backend = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Args: q [T, H, D], k/v [T, Hkv, D], kv the layer's [2, N, page, Hkv, D] cache.
        Returns: [T, H * D]."""
        k_cache, v_cache = kv[0], kv[1]
        self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(q.shape)  # contiguous, whatever q's strides
        if meta.num_decodes:
            self._decode(q, k_cache, v_cache, meta, out)
        self._prefill(q, k_cache, v_cache, meta, out)
        return out.view(q.shape[0], -1)

    def _store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """The step's K/V [T, Hkv, D] into their flat slots (int64 [T]) of the layer's pool."""
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Attention of the ``meta.num_decodes`` leading one-token queries into ``out``."""
        d = meta.num_decodes
        pt = meta.decode_page_table
        assert pt is not None and meta.decode_mask is not None
        flat = pt.view(-1)
        shape = (d, -1, self.num_kv_heads, self.head_dim)
        kd = gather_pages(k_cache, flat).view(shape).transpose(1, 2)
        vd = gather_pages(v_cache, flat).view(shape).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:d].unsqueeze(2), kd, vd, attn_mask=meta.decode_mask, scale=self.scale,
            enable_gqa=True)
        out[:d] = o.squeeze(2)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, out: torch.Tensor) -> None:
        """Causal attention of each prefill chunk over its own pages, into ``out``."""
        for start, end, ctx, pages in meta.prefill:
            n = end - start
            kp = gather_pages(k_cache, pages)[:ctx]
            vp = gather_pages(v_cache, pages)[:ctx]
            qs = q[start:end].transpose(0, 1).unsqueeze(0)
            ks = kp.transpose(0, 1).unsqueeze(0)
            vs = vp.transpose(0, 1).unsqueeze(0)
            if ctx == n:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
            else:
                qpos = torch.arange(ctx - n, ctx, device=q.device)
                mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale,
                                                   enable_gqa=True)
            out[start:end] = o.squeeze(0).transpose(0, 1)


class CpuKernelPagedAttention(SdpaPagedAttention):
    """``SdpaPagedAttention`` with decodes through radixserve's CPU paged decode kernel
    (reads K/V in place, shares each row across a GQA group); prefill stays SDPA.

    Args:
        kernels: the loaded CPU kernel library (``CpuKernels.load()``).
    """

    backend = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kernels: CpuKernels) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.kernels = kernels

    def _store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        self.kernels.store_kv(k, v, k_cache, v_cache, slots)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, out: torch.Tensor) -> None:
        d = meta.num_decodes
        assert meta.decode_page_table is not None and meta.decode_seq_lens is not None
        self.kernels.paged_decode_attention(q[:d], k_cache, v_cache, meta.decode_page_table,
                                            meta.decode_seq_lens, out[:d], self.scale)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, out: torch.Tensor) -> None:
        for start, end, ctx, pages in meta.prefill:
            self.kernels.paged_prefill_attention(q[start:end], k_cache, v_cache, pages, ctx,
                                                 out[start:end], self.scale)

