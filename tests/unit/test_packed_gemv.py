"""The single-row GEMV over oneDNN's packed bf16 weights: on a CPU with AVX512-BF16 it must give
exactly the bits oneDNN's GEMM gives the same row in a batch (the engine's batch invariance
rests on it); elsewhere the GEMM must stay."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.layers.linear import packed_linear
from radixserve.model_executor.layers.packed_gemv import find_k_block, single_row_gemv

#: SmolLM2-135M's projections (qkv, o, gate_up, down) and a narrow LM head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576)]


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    k = CpuKernels.load()
    assert k is not None
    return k


def _has_bf16_gemv(kernels: CpuKernels) -> bool:
    return kernels.has_bf16_dot


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gemv_is_the_gemm_row_for_row(kernels, n, k) -> None:
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    blocks: dict[tuple[int, int], int | None] = {}
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    gemv = single_row_gemv(kernels, packed, w, None, 64, blocks)
    if not _has_bf16_gemv(kernels):
        assert gemv is None and blocks == {}
        return
    assert gemv is not None and blocks[(n, k)] == gemv.k_block
    # activations like the model's: fresh rows, some large, through the GEMM as one batch
    x = torch.randn(96, k, generator=g).to(torch.bfloat16) * torch.logspace(-2, 2, 96)[:, None]
    x = x.to(torch.bfloat16)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    got = torch.cat([gemv(x[i:i + 1]) for i in range(96)])
    assert torch.equal(got, want)
    # and close to the exact product (it is a matrix-vector product, not just a copy)
    torch.testing.assert_close(got.float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-2)


def test_packed_linear_routes_one_row_to_the_gemv(kernels) -> None:
    w = torch.randn(960, 576).to(torch.bfloat16)
    blocks: dict[tuple[int, int], int | None] = {}
    fn = packed_linear(w, None, 64, lambda p, wt, b: single_row_gemv(kernels, p, wt, b, 64,
                                                                       blocks))
    assert fn is not None
    x = torch.randn(3, 576).to(torch.bfloat16)
    batched = fn(x)
    alone = torch.cat([fn(x[i:i + 1]) for i in range(3)])
    assert torch.equal(alone, batched)
    assert (getattr(fn, "single_row", None) is not None) == _has_bf16_gemv(kernels)


def test_gemv_declines_what_it_cannot_reproduce(kernels) -> None:
    blocks: dict[tuple[int, int], int | None] = {}
    mk = torch.ops.mkldnn
    w = torch.randn(960, 576).to(torch.bfloat16)
    bias = torch.randn(960).to(torch.bfloat16)
    assert single_row_gemv(kernels, mk._reorder_linear_weight(w, 64), w, bias, 64,
                           blocks) is None
    w32 = torch.randn(960, 576)
    assert single_row_gemv(kernels, mk._reorder_linear_weight(w32, 64), w32, None, 64,
                           blocks) is None
    odd = torch.randn(100, 576).to(torch.bfloat16)  # N not a multiple of 64
    assert single_row_gemv(kernels, mk._reorder_linear_weight(odd, 64), odd, None, 64,
                           blocks) is None
    assert single_row_gemv(None, mk._reorder_linear_weight(w, 64), w, None, 64, blocks) is None
    assert blocks == {}


def test_wrong_k_blocking_is_caught(kernels) -> None:
    """The probe is what makes the fast path safe: a K blocking other than oneDNN's changes
    some rows' bits, and ``find_k_block`` must notice it."""
    if not _has_bf16_gemv(kernels):
        with pytest.raises(RuntimeError, match="code 5"):
            kernels.gemv_bf16_packed(torch.zeros(1, 576, dtype=torch.bfloat16), 0,
                                     torch.empty(1, 64, dtype=torch.bfloat16), 512)
        return
    kb = find_k_block(kernels, 3072, 576, 64)
    assert kb is not None
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3072, 576, generator=g).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    x = torch.randn(256, 576, generator=g).to(torch.bfloat16)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    ptr = torch.ops.mkldnn.data_ptr(packed)
    out = torch.empty(1, 3072, dtype=torch.bfloat16)
    wrong = 576 if kb != 576 else 64
    differs = 0
    for i in range(256):
        kernels.gemv_bf16_packed(x[i:i + 1], ptr, out, wrong)
        differs += int((out[0] != want[i]).sum())
    assert differs > 0
