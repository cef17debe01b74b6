"""The attention backends by name (``--attention-backend``): torch SDPA over gathered pages,
radixserve's C kernels, its Triton kernels (imported only when chosen: only that backend needs
``triton``). The model asks here for a layer's attention; no backend imports another."""

from __future__ import annotations

from radixserve.model_executor.attention.paged_attention import (
    CpuKernelPagedAttention,
    SdpaPagedAttention,
)
from radixserve.model_executor.kernels.cpu import CpuKernels

#: ``--attention-backend`` values a model can be built with (after "auto" is resolved)
ATTENTION_IMPLS = ("torch", "cpu", "triton")


def build_attention(backend: str, num_heads: int, num_kv_heads: int, head_dim: int,
                    scale: float, kernels: CpuKernels | None = None) -> SdpaPagedAttention:
    """The paged attention of one layer for a resolved ``--attention-backend``.

    Args:
        backend: one of ``ATTENTION_IMPLS``.
        num_heads, num_kv_heads, head_dim: this rank's attention sizes.
        scale: softmax scale.
        kernels: the CPU kernel library; required for "cpu".

    Raises:
        ValueError: an unknown backend, or "cpu" without ``kernels``.
        ImportError: "triton" without the ``triton`` package.
    """
    if backend == "torch":
        return SdpaPagedAttention(num_heads, num_kv_heads, head_dim, scale)
    if backend == "cpu":
        if kernels is None:
            raise ValueError("attention backend 'cpu' needs the CPU kernel library")
        return CpuKernelPagedAttention(num_heads, num_kv_heads, head_dim, scale, kernels)
    if backend == "triton":
        # imported here: only this backend needs triton installed
        from radixserve.model_executor.attention.triton_attention import TritonPagedAttention

        return TritonPagedAttention(num_heads, num_kv_heads, head_dim, scale)
    raise ValueError(f"unknown attention backend {backend!r}; one of {', '.join(ATTENTION_IMPLS)}")
