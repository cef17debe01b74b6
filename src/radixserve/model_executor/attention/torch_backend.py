"""Paged attention over the KV pool.

Decodes (one query token each) use the CPU kernel (``kernels/cpu.py``: keys and values read in
place from their pages) when one is given, else one batched
``torch.nn.functional.scaled_dot_product_attention`` call over their gathered pages, padded to
the longest context and masked (CPU and CUDA). Prefill chunks run one SDPA call per sequence
over its own pages, so no row's reduction depends on what else is in the batch.
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
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_page_table: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefill: list[tuple[int, int, int, torch.Tensor]]


class KVCache:
    """Per-layer KV tensors ``[2, num_pages, page_size, kv_heads, head_dim]`` (DESIGN §4).

    Args:
        num_layers, num_pages, page_size, num_kv_heads, head_dim: sizes.
        dtype, device: storage.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.page_size = page_size
        self.layers = [torch.zeros(2, num_pages, page_size, num_kv_heads, head_dim, dtype=dtype,
                                   device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        """Bytes of K and V for one page across all layers."""
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem


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


class TorchAttention:
    """Writes this step's K/V into the pool and attends over each sequence's pages.

    Args:
        num_heads, num_kv_heads, head_dim: attention sizes (GQA when num_kv_heads < num_heads).
        scale: softmax scale.
        kernels: the CPU kernel library (paged decode attention), or None for the SDPA path.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kernels: CpuKernels | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.kernels = kernels

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Args: q [T, H, D], k/v [T, Hkv, D], kv the layer's [2, N, page, Hkv, D] cache.
        Returns: [T, H * D]."""
        k_cache, v_cache = kv[0], kv[1]
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)
        out = q.new_empty(q.shape)  # contiguous, whatever q's strides
        d = meta.num_decodes
        pt = meta.decode_page_table
        if d and self.kernels is not None and meta.decode_seq_lens is not None:
            assert pt is not None
            self.kernels.paged_decode_attention(q[:d], k_cache, v_cache, pt,
                                                meta.decode_seq_lens, out[:d], self.scale)
        elif d:
            assert pt is not None and meta.decode_mask is not None
            flat = pt.view(-1)
            shape = (d, -1, self.num_kv_heads, self.head_dim)
            kd = gather_pages(k_cache, flat).view(shape).transpose(1, 2)
            vd = gather_pages(v_cache, flat).view(shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[:d].unsqueeze(2), kd, vd, attn_mask=meta.decode_mask, scale=self.scale,
                enable_gqa=True)
            out[:d] = o.squeeze(2)
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
        return out.view(q.shape[0], -1)
