"""Whether a model's weights fit in this machine's memory, checked before any is read.

On a CPU without native bf16 (the AVX2 kind), ``--dtype auto`` means float32. A bf16
checkpoint then keeps its weights in bf16 under float32 activations (``weight_storage``: the
caller's ``bytes_for`` counts them so); any other checkpoint in float32 may not fit: a 7B
model's 30 GB exceed a 24 GB machine. Rather than run out of memory twenty seconds into
loading, ``auto`` then serves the model in bfloat16, and an explicit dtype that cannot fit is
refused at once, naming the sizes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.model_executor.models.llama import ModelArgs

#: the share of MemAvailable the weights may take (the rest: the KV pool, activations, the
#: interpreter and the tokenizer)
FIT_FRACTION = 0.9


def mem_available_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def weight_bytes(a: ModelArgs, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters in ``dtype`` (embedding, LM head unless tied, every
    layer's projections, biases and norms)."""
    q, kv, h, it = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.hidden_size, \
        a.intermediate_size
    layer = (q + 2 * kv) * h + h * q + 2 * it * h + h * it + 2 * h
    if a.qkv_bias:
        layer += q + 2 * kv
    if a.qk_norm:
        layer += 2 * a.head_dim
    n = a.vocab_size * h * (1 if a.tie_word_embeddings else 2) + a.num_layers * layer + h
    return n * torch.empty(0, dtype=dtype).element_size()


def fit_dtype(asked: str, dtype: torch.dtype, a: ModelArgs, device: torch.device,
              shards: int = 1, available: int | None = None,
              bytes_for: Callable[[torch.dtype], int] | None = None
              ) -> tuple[torch.dtype, str | None]:
    """The dtype to serve in, given what fits: ``dtype`` itself, or bfloat16 where ``asked``
    is "auto", ``dtype`` is float32 and its weights would not fit while bf16's would.

    Args:
        asked: the ``--dtype`` value ("auto", "float32", ...).
        dtype: what it resolved to on this machine (``runner.resolve_dtype``).
        a: the model's sizes.
        device: checked on CPU only (GPU memory is the CUDA allocator's business).
        shards: tensor-parallel ranks on this machine (each holds about 1/shards).
        available: MemAvailable in bytes (None: read it now).
        bytes_for: the weights' bytes when served with activations in a dtype (None:
            ``weight_bytes``; quantized weights take fewer, ``quantization``).

    Returns:
        ``(dtype, reason)``: reason says why the dtype changed, else None.

    Raises:
        ValueError: the weights in the resulting dtype exceed ``FIT_FRACTION`` of the
            available memory, with both sizes and what to try.
    """
    if device.type != "cpu":
        return dtype, None
    avail = mem_available_bytes() if available is None else available
    if avail is None:
        return dtype, None
    budget = FIT_FRACTION * avail
    size = bytes_for or (lambda dt: weight_bytes(a, dt))
    need = size(dtype) / shards
    gib = 1 << 30
    if need <= budget:
        return dtype, None
    half = size(torch.bfloat16) / shards
    if asked == "auto" and dtype == torch.float32 and half <= budget:
        return torch.bfloat16, (f"float32 weights ({need / gib:.1f} GiB) do not fit in the "
                                f"{avail / gib:.1f} GiB available; bfloat16 ({half / gib:.1f} "
                                "GiB) does")
    hint = ("; try --dtype bfloat16" if dtype == torch.float32 and half <= budget
            else "; serve a quantized GGUF of it, or use a machine with more memory")
    raise ValueError(f"the model's {str(dtype).removeprefix('torch.')} weights need "
                     f"{need / gib:.1f} GiB but only {avail / gib:.1f} GiB of memory is "
                     f"available{hint}")
