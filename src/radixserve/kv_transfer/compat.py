"""What two instances must share to exchange KV pages, and where a page lives in memory.

The compatibility factors follow vLLM's ``compute_nixl_compatibility_hash`` (model, dtype, KV
heads, head size, layers, connector version) plus the page size, which vLLM validates at
handshake separately: radixserve copies whole pages, so both sides must page alike.
"""

from __future__ import annotations

import hashlib
import json

import msgspec
import torch

#: Bumped on any change that breaks exchanging pages between two versions (layout, protocol).
CONNECTOR_VERSION = 1


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """One instance's KV pool as a peer sees it.

    Every layer's tensor is ``[2, num_pages, page_size, num_kv_heads, head_dim]``
    (``kvcache/storage.py``), so the K (kv=0) or V (kv=1) slots of page p of layer l are
    ``page_bytes`` contiguous bytes at ``base_addrs[l] + (kv * num_pages + p) * page_bytes``.

    Attributes:
        model: the model's name; dtype: the KV dtype ("float32", "bfloat16", ...).
        num_layers / num_kv_heads / head_dim / page_size: KV geometry (page_size in tokens).
        num_pages: pages per layer tensor, the null page 0 included.
        page_bytes: bytes of one page's K (or V) in one layer.
        base_addrs: per layer the tensor's address in the owner's memory.
        device_id: the CUDA device index of the tensors, 0 on CPU (NIXL's device column).
        mem_type: "DRAM" (CPU tensors) or "VRAM" (CUDA tensors), NIXL's memory types.
    """

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    page_bytes: int
    base_addrs: list[int]
    device_id: int = 0
    mem_type: str = "DRAM"

    @classmethod
    def of(cls, model: str, kv_caches: list[torch.Tensor]) -> KVLayout:
        """The layout of per-layer tensors shaped ``[2, num_pages, page_size, heads, dim]``.

        Raises:
            ValueError: no tensors, tensors of different shapes or dtypes, or not contiguous.
        """
        if not kv_caches:
            raise ValueError("no KV cache tensors to register")
        first = kv_caches[0]
        for t in kv_caches:
            if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
                raise ValueError("KV cache tensors must be contiguous and alike")
        if first.dim() != 5 or first.shape[0] != 2:
            raise ValueError(f"KV cache tensor shape {tuple(first.shape)} is not "
                             f"[2, num_pages, page_size, num_kv_heads, head_dim]")
        _, num_pages, page_size, heads, dim = first.shape
        return cls(model=model, dtype=str(first.dtype).removeprefix("torch."),
                   num_layers=len(kv_caches), num_kv_heads=heads, head_dim=dim,
                   page_size=page_size, num_pages=num_pages,
                   page_bytes=page_size * heads * dim * first.element_size(),
                   base_addrs=[t.data_ptr() for t in kv_caches],
                   device_id=first.device.index or 0,
                   mem_type="VRAM" if first.device.type == "cuda" else "DRAM")

    def factors(self) -> dict[str, object]:
        """What must be equal on both sides of a transfer."""
        return {"connector_version": CONNECTOR_VERSION, "model": self.model,
                "dtype": self.dtype, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "page_size": self.page_size}


def compat_hash(factors: dict[str, object]) -> str:
    """SHA-256 hex digest of the factors (sorted JSON), as vLLM hashes its factors."""
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def describe_mismatch(ours: dict[str, object], theirs: dict[str, object],
                      our_role: str, their_role: str) -> str:
    """A sentence naming every factor that differs, e.g. ``page_size 16 (decode) != 8
    (prefill)``; "" when none does."""
    diffs = [f"{k} {ours.get(k)!r} ({our_role}) != {theirs.get(k)!r} ({their_role})"
             for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
    return "; ".join(diffs)
