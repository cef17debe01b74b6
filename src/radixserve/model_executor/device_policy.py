"""Where and how the model runs, decided before loading: the device, the dtype, the attention
backend (radixserve's C kernels, its Triton kernels or torch SDPA) and the record of every path
taken and why (``ForwardPaths``, logged at start-up and served in ``/metrics``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.model_executor.kernels.cpu import CpuKernels

log = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    """True when the CPU has AVX512-BF16 or AMX-BF16 (bf16 matmul ~4x fp32 there)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """"auto" -> bfloat16 on CUDA and bf16-capable CPUs, else float32."""
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[dtype]


def select_cpu_kernels(backend: str, device: torch.device,
                       dtype: torch.dtype) -> CpuKernels | None:
    """radixserve's CPU kernels (paged decode attention, fused add + RMSNorm) for
    ``--attention-backend``.

    "auto": the kernels on CPU for float32/bfloat16 when they build, else torch ops (SDPA);
    "torch": always torch ops (the reference path); "cpu": the kernels or an error; "triton":
    none (Triton attention, torch ops for the element-wise steps).

    Raises:
        ValueError: "cpu" asked for but not possible here (device, dtype or no compiler).
    """
    if backend in ("torch", "triton"):
        return None
    usable = CpuKernels.supports(dtype, device)
    if backend == "cpu" and not usable:
        raise ValueError(f"attention_backend='cpu' needs device cpu and float32/bfloat16, "
                         f"got {device} {dtype}")
    kernel = CpuKernels.load() if usable else None
    if backend == "cpu" and kernel is None:
        raise ValueError("attention_backend='cpu': the CPU attention kernel could not be built "
                         "(see the log; it needs a C compiler)")
    return kernel


def select_layer_ops(backend: str, device: torch.device) -> tuple[Any, str | None, str]:
    """The fused norm / RoPE / activation steps (``models.llama.LayerOps``) on CUDA, for
    ``--attention-backend``: radixserve's Triton kernels (``kernels.triton_ops``) unless
    "torch" (the reference path: torch ops throughout) or triton does not import. On CPU the
    C kernels are these steps (``select_cpu_kernels``): (None, None, why).

    Returns: (the ops or None, the path name "triton"/"torch" or None on CPU, why)."""
    if device.type != "cuda":
        return None, None, "on CPU the C kernels fuse these steps"
    if backend == "torch":
        return None, "torch", "--attention-backend torch: the reference path, torch ops throughout"
    try:
        from radixserve.model_executor.kernels.triton_ops import TritonLayerOps
    except Exception as e:  # ImportError, or a triton that fails while importing
        return None, "torch", f"triton does not import ({e})"
    return TritonLayerOps(), "triton", (
        "radixserve's Triton kernels: residual add + RMSNorm, RoPE and SiLU-mul in one launch "
        "each (a decode step's kernel count and CUDA-graph launch time about halve)")


def select_triton(backend: str, device: torch.device,
                  dtype: torch.dtype = torch.float32) -> tuple[bool, str | None]:
    """Whether attention runs in radixserve's Triton kernels (``attention/triton_attention``)
    for ``--attention-backend``, and why not when "auto" could have used them.

    "triton": the kernels or an error; "auto": the kernels on CUDA when ``triton`` imports
    (the reason names the failure otherwise); "cpu", "torch": no. On CPU the kernels run only
    in Triton's interpreter (``TRITON_INTERPRET=1`` before the first import: tests), and not
    in bfloat16, whose dots the interpreter gets wrong.

    Raises:
        ValueError: "triton" asked for but ``triton`` does not import, or the device is not
            CUDA and the kernels are not interpreted, or interpreted in bfloat16.
    """
    if backend not in ("triton", "auto") or (backend == "auto" and device.type != "cuda"):
        return False, None
    try:
        from radixserve.model_executor.attention import triton_attention
    except Exception as e:  # ImportError, or a triton that fails while importing
        if backend == "triton":
            raise ValueError(f"attention_backend='triton' needs the triton package "
                             f"(pip install 'radixserve[triton]'): {e}") from e
        return False, f"triton does not import ({e})"
    if not triton_attention.supports_device(device):
        raise ValueError(f"attention_backend='triton' runs on CUDA, not {device.type} (on CPU "
                         "only in Triton's interpreter: TRITON_INTERPRET=1, for tests)")
    if device.type != "cuda" and dtype == torch.bfloat16:
        raise ValueError("attention_backend='triton' on CPU (Triton's interpreter) needs "
                         "float32 or float16: the interpreter's bfloat16 tl.dot multiplies raw "
                         "bits (triton-lang/triton#11584)")
    return True, None



@dataclass
class ForwardPaths:
    """The code path each part of the forward runs ("attention": "cpu" | "triton" | "torch",
    "linear": "packed" | "dense"), why, which fast paths fell back, and the steps run."""

    paths: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)
    steps: int = 0

    def pick(self, part: str, path: str, reason: str, fallback: bool = False) -> None:
        self.paths[part] = path
        self.reasons[part] = reason
        if fallback:
            self.fallbacks[part] = reason
            log.warning("%s: fast path unavailable, using %s: %s", part, path, reason)


def attention_reason(asked: str, device: torch.device, dtype: torch.dtype,
                      built: bool, triton: bool = False,
                      no_triton: str | None = None) -> tuple[str, bool]:
    """Why the attention path is what it is, and whether that is a fall-back."""
    if asked in ("torch", "triton"):
        return f"--attention-backend {asked}", False
    if triton:
        return ("radixserve's Triton kernels on CUDA: split-KV decode and paged extend, K/V "
                "read in place from their pages"), False
    if no_triton is not None:
        return f"the Triton kernels are unavailable: {no_triton}", True
    if built:
        return ("radixserve's C kernels: prefill and decode rows share one arithmetic "
                "(batch-invariant), faster decode than SDPA (docs/benchmarks.md)"), False
    if not CpuKernels.supports(dtype, device):
        return f"the C kernels run on CPU in float32/bfloat16, not {device.type} {dtype}", False
    return "the C kernels failed to build or load (see the log above)", True


def attention_isa(kernels: CpuKernels, dtype: torch.dtype) -> tuple[str, str]:
    """The instruction-set path of the C attention kernels for ``dtype``, and why."""
    if dtype != torch.bfloat16:
        return "portable", f"{dtype} runs the portable vector code on every CPU"
    isa = kernels.bf16_attention_isa
    why = {"avx512-bf16": "AVX512-BF16 pair dot products for the scores, value rows widened "
                          "in registers (1.3-1.5x per layer on Zen 5, docs/benchmarks.md)",
           "avx512": "value rows widened in registers; no AVX512-BF16 for the scores",
           "portable": "no AVX-512 on this CPU: the portable vector code"}[isa]
    return isa, why
