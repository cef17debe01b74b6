"""Float32 linears over bfloat16 weights held as a checkpoint ships them: each row must get the
bits of the float32 kernel over the widened weights (so those of oneDNN's float32 GEMM where
the K blocking is oneDNN's), in any batch, on every kernel build (AVX-512 and AVX2)."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.layers.bf16_weight_linear import Bf16WeightLinear
from radixserve.model_executor.layers.packed_kernel import find_k_block, layout_matches
from radixserve.model_executor.models.decode_stack import W_BF16

#: SmolLM2's qkv and down, Qwen2.5-1.5B's qkv, and a narrow head with K not a multiple of 8
SHAPES = [(960, 576), (576, 1536), (2048, 1536), (192, 100)]
#: 1 row (the whole-block path), tiles of 6, partial tiles, many tiles per panel (the
#: widened scratch), and more than one chunk of 48 rows over it (a partial last chunk)
ROWS = [1, 2, 5, 6, 7, 13, 64, 100, 200, 389]


@pytest.fixture(scope="module")
def kernels(kernel_build: str) -> CpuKernels:
    k = CpuKernels.load(kernel_build)
    assert k is not None
    assert k.f32_gemm_isa is not None, "the x86 kinds all build the float32 GEMM"
    return k


@pytest.mark.parametrize("n,k", SHAPES)
def test_rows_get_the_float32_kernels_bits_in_any_batch(kernels: CpuKernels, n: int,
                                                        k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    wide = w.float()
    packed = torch.ops.mkldnn._reorder_linear_weight(wide, 64)
    same_layout = layout_matches(packed, n, k)
    for kb in (k, 32):
        lin = Bf16WeightLinear(kernels, w, None, kb)
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            y = lin(x)
            assert y.dtype == torch.float32 and y.shape == (m, n)
            if same_layout:  # the float32 kernel reads oneDNN's buffer: same sums, same bits
                want = torch.empty(m, n)
                kernels.linear_packed(x, torch.ops.mkldnn.data_ptr(packed), want, kb)
                assert torch.equal(y, want), (kb, m)
            ref = x.double() @ wide.double().T
            assert (y.double() - ref).abs().max().item() < 1e-3
            alone = torch.cat([lin(x[i:i + 1]) for i in range(m)])
            assert torch.equal(y, alone), (kb, m)


def test_oneDNN_blocking_gives_oneDNN_float32_bits(kernels: CpuKernels) -> None:
    n, k = 960, 576
    kb = find_k_block(kernels, n, k, 64, torch.float32)
    if kb is None:
        pytest.skip("oneDNN's float32 GEMM has no reproducible K blocking on this machine")
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(5)) * 0.05).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w.float(), 64)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(6))
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    assert torch.equal(Bf16WeightLinear(kernels, w, None, kb)(x), want)


def test_bias_rows_and_weight(kernels: CpuKernels) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 64, generator=g).bfloat16()
    bias = torch.randn(128, generator=g)
    lin = Bf16WeightLinear(kernels, w, bias, 64)
    x = torch.randn(3, 64, generator=g)
    assert torch.equal(lin(x), Bf16WeightLinear(kernels, w, None, 64)(x) + bias)
    ids = torch.tensor([0, 63, 64, 127, 5])
    assert torch.equal(lin.rows(ids), w.float()[ids])
    assert torch.equal(lin.weight(), w)
    assert lin.bias is bias


def test_bad_weights_and_inputs_are_refused(kernels: CpuKernels) -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        Bf16WeightLinear(kernels, torch.zeros(100, 64, dtype=torch.bfloat16), None, 64)
    with pytest.raises(ValueError, match="bfloat16"):
        Bf16WeightLinear(kernels, torch.zeros(64, 64), None, 64)
    with pytest.raises(ValueError, match="bias"):
        Bf16WeightLinear(kernels, torch.zeros(64, 64, dtype=torch.bfloat16),
                         torch.zeros(64, dtype=torch.bfloat16), 64)
    lin = Bf16WeightLinear(kernels, torch.zeros(64, 64, dtype=torch.bfloat16), None, 64)
    with pytest.raises(ValueError, match="float32"):
        lin(torch.zeros(2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        lin(torch.zeros(2, 32))


def test_decode_stack_flag_leaves_room_for_any_k_block() -> None:
    # the C side masks the flag off the K blocking: it must sit above any K a model has
    assert W_BF16 > 1 << 32
