"""A decoder layer's elementwise steps in one Triton kernel each, on CUDA: residual add +
RMSNorm, rotate-half RoPE in place, and SwiGLU's ``silu(gate) * up``.

Why: in torch ops a layer's RMSNorms, RoPE and activation are ~19 small kernels (casts, powers,
means, slices, products, a concatenation). On an H200 a Qwen2.5-0.5B-shaped decode step ran 683
kernels, each ~1-2 µs on the GPU however small, and replaying that CUDA graph cost ~1.3 ms of
CPU in ``cudaGraphLaunch`` with the GPU idle (benchmarks/gpu/profile_step.py, docs/benchmarks.md
"GPU decode"). These three kernels replace them with 4 launches per layer.

Numerics are those of the torch reference (``models.llama.rms_norm``, ``apply_rope``, ``F.silu``):
float32 arithmetic with every intermediate rounded to the activation dtype where torch's ops
round it, so bfloat16 results agree with the torch path but for the mean square's summation
order and the GPU's ``rsqrt``/``exp`` (last-bit differences; the parity tests allow near-ties).
The same interface as the CPU kernels (``kernels.cpu.CpuKernels``): the model calls either.

On CPU tensors the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1`` before triton
is first imported), which is how the unit tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

#: activation dtypes the kernels take
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, eps, stride_x, stride_r, stride_o,
                         HAS_X: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    """One row: ``r = res + x`` (stored back, rounded to the dtype), ``out = w * round(r *
    rsqrt(mean(r²) + eps))`` with the mean in float32."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
    if HAS_X:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        r = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + row * stride_r + cols, r, mask=mask)
    rf = r.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(rf * rf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ROUND:  # torch: weight * F.rms_norm(r.float()).to(dtype), a product of two bf16 values
        y = (rf * inv).to(r.dtype).to(tl.float32) * w
    else:  # float32: F.rms_norm(r, weight) in one expression
        y = rf * inv * w
    tl.store(out_ptr + row * stride_o + cols, y.to(r.dtype), mask=mask)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, heads, half, stride_t, stride_h, stride_c,
                 ROUND: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token, every head: ``(x1, x2) <- (x1 c - x2 s, x2 c + x1 s)``, each product and sum
    rounded to the dtype where torch's bfloat16 ops round it."""
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < half)
    p1 = x_ptr + t * stride_t + h * stride_h + d
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + half, mask=mask, other=0.0)
    c = tl.load(cos_ptr + t * stride_c + d, mask=d < half, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_c + d, mask=d < half, other=0.0).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    if ROUND:
        dt = x1.dtype
        o1 = ((a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)).to(dt)
        o2 = ((a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)).to(dt)
    else:
        o1 = a1 * c - a2 * s
        o2 = a2 * c + a1 * s
    tl.store(p1, o1.to(x1.dtype), mask=mask)
    tl.store(p1 + half, o2.to(x1.dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_g, stride_o, ROUND: tl.constexpr,
                     BLOCK: tl.constexpr):
    """``out = round(silu(gate)) * up`` over one block of one row."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_g + inter + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = gf / (1.0 + tl.exp(-gf))
    if ROUND:
        act = act.to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * u.to(tl.float32)).to(g.dtype), mask=mask)


#: whether this process runs the kernels in Triton's interpreter (CPU tensors only)
INTERPRETED = isinstance(_rope_kernel, InterpretedFunction)
# interpreted and compiled functions cannot mix in one launch: see triton_attention's same check
if isinstance(tl.sum, InterpretedFunction) != INTERPRETED:
    raise ImportError("TRITON_INTERPRET changed between importing triton and "
                      f"{__name__}: set it (or unset it) before triton is first imported")


def supports_device(device: torch.device) -> bool:
    """CUDA, or any device while the kernels run in Triton's interpreter (which also reads
    ``TRITON_INTERPRET`` while kernels run)."""
    return device.type == "cuda" or (INTERPRETED and bool(triton.knobs.runtime.interpret))


class TritonLayerOps:
    """The layer steps the model calls per op (``models.llama.LayerOps``) as Triton kernels."""

    def add_rms_norm(self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """``residual += x`` in place (skipped when x is None), then RMSNorm of the new residual
        (``models.llama.rms_norm``'s numerics).

        Args:
            x: [M, N] in residual's dtype, last dim contiguous, or None.
            residual: [M, N] float32/bfloat16/float16, last dim contiguous; updated in place.
            weight: [N], contiguous.
            eps: added to the mean square.
            out: where to write the result ([M, N], residual's dtype, last dim contiguous), x
                itself included (a program loads its row whole before storing it); None: a
                new tensor.
        Returns: ``out``, or a new contiguous [M, N] tensor in residual's dtype.

        Raises:
            ValueError: wrong dtype or layout.
        """
        m, n = residual.shape
        _check(residual, "residual")
        if x is not None:
            _check(x, "x")
            if x.shape != residual.shape or x.dtype != residual.dtype:
                raise ValueError(f"x {tuple(x.shape)} {x.dtype} must match residual "
                                 f"{tuple(residual.shape)} {residual.dtype}")
        if weight.shape != (n,) or not weight.is_contiguous():
            raise ValueError(f"weight must be contiguous [{n}], got {tuple(weight.shape)}")
        if out is None:
            out = torch.empty_like(residual, memory_format=torch.contiguous_format)
        else:
            _check(out, "out")
            if out.shape != residual.shape or out.dtype != residual.dtype:
                raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match residual "
                                 f"{tuple(residual.shape)} {residual.dtype}")
        if m == 0:
            return out
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(m,)](
            residual if x is None else x, residual, weight, out, n, eps,
            0 if x is None else x.stride(0), residual.stride(0), out.stride(0),
            HAS_X=x is not None, ROUND=residual.dtype != torch.float32, BLOCK=block,
            num_warps=min(16, max(1, block // 256)))
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE (Hugging Face / GPT-NeoX layout) applied to ``x`` in place, with
        ``models.llama.apply_rope``'s rounding.

        Args:
            x: [T, heads, D], D even, D contiguous (the token and head strides are free: Q and
                K may be a view of the fused QKV output).
            cos, sin: [T, D // 2] in x's dtype, last dim contiguous.
        Returns: x.

        Raises:
            ValueError: wrong dtype, shape or layout.
        """
        t, heads, d = x.shape
        _check(x, "x")
        if d % 2 or cos.shape != (t, d // 2) or sin.shape != cos.shape \
                or cos.dtype != x.dtype or sin.dtype != x.dtype or cos.stride(1) != 1 \
                or sin.stride() != cos.stride():
            raise ValueError(f"rope_: x {tuple(x.shape)} {x.dtype} needs cos and sin of "
                             f"[{t}, {d // 2}] in its dtype, got {tuple(cos.shape)} {cos.dtype}, "
                             f"{tuple(sin.shape)} {sin.dtype}")
        if t:
            _rope_kernel[(t,)](x, cos, sin, heads, d // 2, x.stride(0), x.stride(1),
                               cos.stride(0), ROUND=x.dtype != torch.float32,
                               BLOCK_H=triton.next_power_of_2(heads),
                               BLOCK_D=triton.next_power_of_2(d // 2))
        return x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation ``silu(gate) * up`` of the fused gate/up projection's output;
        the SiLU is rounded to the activation dtype before the product, as torch's two ops do.

        Args:
            gate_up: [T, 2 * I] (gate, then up), last dim contiguous.
        Returns: a new contiguous [T, I] tensor in gate_up's dtype.

        Raises:
            ValueError: wrong dtype, shape or layout.
        """
        t, two_i = gate_up.shape
        _check(gate_up, "gate_up")
        if two_i % 2:
            raise ValueError(f"gate_up's last dim must be even, got {two_i}")
        inter = two_i // 2
        out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024, triton.next_power_of_2(inter))
        if t:
            _silu_mul_kernel[(t, triton.cdiv(inter, block))](
                gate_up, out, inter, gate_up.stride(0), out.stride(0),
                ROUND=gate_up.dtype != torch.float32, BLOCK=block)
        return out


def _check(t: torch.Tensor, name: str) -> None:
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}'s last dim must be contiguous, got strides {t.stride()}")
    if not supports_device(t.device):
        raise ValueError(f"the Triton layer kernels run on CUDA, not {t.device.type} (on CPU "
                         "only in Triton's interpreter: TRITON_INTERPRET=1, for tests)")
