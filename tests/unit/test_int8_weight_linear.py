"""Weight-only int8 per output channel (``--quantization int8``): the quantizer's rounding, and
the kernel's rows, which must be the float32 kernel's bits over the widened int8 values times
the scale, in any batch, on every kernel build (AVX-512 and AVX2)."""

from __future__ import annotations

import pytest
import torch
from test_bf16_weight_linear import ROWS, SHAPES

from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.layers.int8_weight_linear import (
    Int8WeightLinear,
    quantize_per_channel,
)


@pytest.fixture(scope="module")
def kernels(kernel_build: str) -> CpuKernels:
    k = CpuKernels.load(kernel_build)
    assert k is not None
    assert k.quant.has_int8w, "the x86 kinds all build the float32 GEMM"
    return k


def _pack_f32(w: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] in the float32 kernel's [N/64][K][64] layout."""
    n, k = w.shape
    return w.reshape(n // 64, 64, k).transpose(1, 2).contiguous()


def test_quantizer_rounds_each_row_to_its_own_scale() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 96, generator=g) * torch.logspace(-3, 1, 70)[:, None]
    w[3] = 0
    q, scale = quantize_per_channel(w.bfloat16())
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (70,)
    assert scale[3] == 0 and not q[3].any()
    wf = w.bfloat16().float()
    assert torch.equal(scale, wf.abs().amax(dim=1) / 127)
    # the largest value of each row lands on +-127, every value within half a step
    assert torch.equal(q.abs().amax(dim=1)[scale > 0], torch.full((69,), 127, dtype=torch.int8))
    # (float32 division may round a value a hair past the midpoint the other way)
    err = (q.double() * scale.double()[:, None] - wf.double()).abs()
    assert (err <= scale.double()[:, None] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("n,k", SHAPES)
def test_rows_get_the_float32_kernels_bits_times_the_scale_in_any_batch(
        kernels: CpuKernels, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    q, scale = quantize_per_channel(torch.randn(n, k, generator=g) * 0.05)
    lin = Int8WeightLinear(kernels.quant, q, scale)
    wide = _pack_f32(q.float())
    deq = q.double() * scale.double()[:, None]
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        y = lin(x)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        want = torch.empty(m, n)
        kernels.linear_packed(x, wide.data_ptr(), want, k)
        assert torch.equal(y, want * scale), m
        ref = x.double() @ deq.T
        assert (y.double() - ref).abs().max().item() < 1e-3
        alone = torch.cat([lin(x[i:i + 1]) for i in range(m)])
        assert torch.equal(y, alone), m


def test_bfloat16_rows_bias_and_weight(kernels: CpuKernels) -> None:
    g = torch.Generator().manual_seed(2)
    q, scale = quantize_per_channel(torch.randn(128, 64, generator=g))
    bias = torch.randn(128, generator=g)
    lin = Int8WeightLinear(kernels.quant, q, scale, bias)
    x = torch.randn(9, 64, generator=g)
    plain = Int8WeightLinear(kernels.quant, q, scale)
    assert torch.equal(lin(x), plain(x) + bias)
    xb = x.bfloat16()
    blin = Int8WeightLinear(kernels.quant, q, scale, bias.bfloat16())
    got = blin(xb)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, plain(xb.float()).bfloat16() + bias.bfloat16())
    assert torch.equal(lin.weight(), q.float() * scale[:, None])
    assert lin.nbytes() == 128 * 64 + 4 * 128


def test_bad_weights_and_inputs_are_refused(kernels: CpuKernels) -> None:
    qk = kernels.quant
    ones = torch.ones(64)
    with pytest.raises(ValueError, match="int8"):
        Int8WeightLinear(qk, torch.zeros(64, 64), ones)
    with pytest.raises(ValueError, match="scale"):
        Int8WeightLinear(qk, torch.zeros(64, 64, dtype=torch.int8), torch.ones(32))
    with pytest.raises(ValueError, match="bias"):
        Int8WeightLinear(qk, torch.zeros(64, 64, dtype=torch.int8), ones, torch.zeros(3))
    lin = Int8WeightLinear(qk, torch.zeros(64, 64, dtype=torch.int8), ones)
    with pytest.raises(ValueError, match="float32/bfloat16"):
        lin(torch.zeros(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        lin(torch.zeros(2, 32))
    assert lin(torch.zeros(0, 64)).shape == (0, 64)


def test_outputs_not_a_whole_panel_are_padded_and_cut(kernels: CpuKernels) -> None:
    """N = 80 (a tensor-parallel half of 160 outputs): padded to 128 in the kernel, the
    first 80 outputs returned, each the bits it gets inside a whole-panel weight."""
    g = torch.Generator().manual_seed(4)
    q, scale = quantize_per_channel(torch.randn(128, 96, generator=g))
    x = torch.randn(7, 96, generator=g)
    part = Int8WeightLinear(kernels.quant, q[:80], scale[:80])
    assert part.n_padded == 128
    y = part(x)
    assert y.shape == (7, 80) and y.is_contiguous()
    assert torch.equal(y, Int8WeightLinear(kernels.quant, q, scale)(x)[:, :80])
    assert torch.equal(part.weight(), q[:80].float() * scale[:80, None])
