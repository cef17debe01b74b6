"""The KV pool's memory: one K/V tensor per layer, addressed by page (DESIGN §4). Page
ownership (free list, radix cache) is ``KVCacheManager``'s; this module only holds the bytes."""

from __future__ import annotations

import torch


class KVStorage:
    """Per-layer KV tensors ``[2, num_pages, page_size, kv_heads, head_dim]``.

    Args:
        num_layers, num_pages, page_size, num_kv_heads, head_dim: sizes (pages include the
            null page 0, which padded page-table entries point at).
        dtype, device: storage.

    Attributes:
        layers: one tensor per layer, K at index 0 and V at index 1 of its first dimension.
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
