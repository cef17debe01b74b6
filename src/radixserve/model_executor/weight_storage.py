"""Whether a float32 model holds its linear weights in bfloat16, as its checkpoint ships them.

Served in float32 (``--dtype auto`` on a CPU without native bf16 arithmetic, or asked for), a
bf16 checkpoint's weights would be widened at load: twice the memory, and twice the bytes each
decode step streams, for no change in any value. Where radixserve's float32 GEMM is built, the
embedding, the LM head and the projections stay bf16 instead and are widened in registers
(``layers.bf16_weight_linear``); the decision is made from the checkpoint's headers before any
weight is read, so that the memory check and the parameters see the smaller size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.layers.bf16_weight_linear import BLOCK_N
from radixserve.model_executor.models.llama import ModelArgs


def checkpoint_matrix_dtypes(folder: Path) -> set[str]:
    """The safetensors dtypes ("BF16", "F32", ...) of the 2-D tensors in ``folder``'s
    ``*.safetensors`` files, read from their headers only.

    Raises:
        ValueError: an unreadable safetensors file (naming it).
    """
    from safetensors import SafetensorError, safe_open

    dtypes: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    sl = f.get_slice(name)
                    if len(sl.get_shape()) == 2:
                        dtypes.add(sl.get_dtype())
        except SafetensorError as e:
            raise ValueError(f"{file} is not a valid safetensors file: {e}") from e
    return dtypes


def bf16_weights_reason(*, linear_kernel: bool, pack_weights: bool | None,
                        attention_backend: str, device: torch.device,
                        quantization: str | None, gguf: Path | None, folder: Path,
                        local: ModelArgs, vocab_rows: int) -> str | None:
    """None where a float32 model of this checkpoint can hold its weights in bf16, else why
    not (for the start-up log). The dtype itself is checked by the caller.

    Args:
        linear_kernel, pack_weights, attention_backend: ``EngineConfig``'s
            ``cpu_linear_kernel``, ``pack_weights`` and ``attention_backend``.
        device, quantization, gguf: the resolved device, quantization and GGUF file.
        folder: the checkpoint folder.
        local: this rank's sizes (``ShardLayout.local_args``), vocab_rows its vocabulary rows.
    """
    if device.type != "cpu":
        return f"weights are held in the serving dtype on {device.type}"
    if quantization is not None or gguf is not None:
        return "a GGUF or quantized model holds its own formats"
    if not linear_kernel or pack_weights is False or attention_backend in ("torch", "triton"):
        return ("the float32 GEMM over bf16 weights is radixserve's kernel: off with "
                "--no-cpu-linear-kernel, --no-pack-weights or --attention-backend torch")
    dtypes = checkpoint_matrix_dtypes(folder)
    if dtypes != {"BF16"}:
        return f"the checkpoint's matrices are {sorted(dtypes) or 'absent'}, not all BF16"
    q, kv = local.num_heads * local.head_dim, local.num_kv_heads * local.head_dim
    outs = {"qkv": q + 2 * kv, "o": local.hidden_size, "gate_up": 2 * local.intermediate_size,
            "down": local.hidden_size, "lm_head": vocab_rows}
    odd = {n: v for n, v in outs.items() if v % BLOCK_N}
    if odd:
        return f"output sizes {odd} are not multiples of {BLOCK_N}"
    kernels = CpuKernels.load()
    if kernels is None or kernels.f32_gemm_isa is None:
        return "radixserve's float32 GEMM is not built here (AVX2 + FMA and a C compiler)"
    return None
