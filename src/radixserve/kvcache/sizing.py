"""How many KV pages the pool gets and the longest sequence it then allows: the one sizing rule
that the model runner and the null runner both use (DESIGN §4)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolPlan:
    """Attributes: num_pages: pages in the pool, the null page 0 included; max_model_len:
    longest sequence in tokens (prompt + output) that the pool and the model allow."""

    num_pages: int
    max_model_len: int


def pool_max_len(num_pages: int, page_size: int, model_len: int) -> int:
    """Longest sequence (tokens) a pool of ``num_pages`` pages (null page included) can hold
    for one request, capped at ``model_len``."""
    return int(min(model_len, (num_pages - 1) * page_size))


def plan_kv_pool(*, page_size: int, num_pages: int | None, kv_cache_memory: int,
                 bytes_per_page: int, max_num_seqs: int, model_max_len: int,
                 max_model_len: int | None) -> PoolPlan:
    """Size the KV pool.

    Args:
        page_size: tokens per page.
        num_pages: an explicit page count, or None to size from ``kv_cache_memory``.
        kv_cache_memory: pool budget in bytes.
        bytes_per_page: K and V bytes of one page across all layers.
        max_num_seqs: most requests at once; the pool never gets more pages than that many
            full-length sequences could use (plus the null page).
        model_max_len: the model's context length in tokens.
        max_model_len: the asked-for longest sequence, or None for the model's.

    Raises:
        ValueError: ``max_model_len`` exceeds the model's context length.
    """
    if max_model_len and max_model_len > model_max_len:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context length "
                         f"{model_max_len}")
    want = max_model_len or model_max_len
    n = num_pages if num_pages is not None else max(2, kv_cache_memory // max(bytes_per_page, 1))
    n = int(min(n, max_num_seqs * -(-want // page_size) + 1))
    return PoolPlan(n, pool_max_len(n, page_size, want))
