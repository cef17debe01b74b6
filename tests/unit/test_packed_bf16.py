"""radixserve's linear kernel over oneDNN's packed bf16 weights (a GEMV for one row, a GEMM for
up to ``MAX_ROWS``): on a CPU with AVX512-BF16 every row must get exactly the bits oneDNN's GEMM
gives it in any batch (the engine's batch invariance rests on it); elsewhere oneDNN must stay."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.layers.linear import packed_linear
from radixserve.model_executor.layers.packed_bf16 import (
    MAX_ROWS,
    find_k_block,
    packed_bf16_linear,
)

#: SmolLM2-135M's projections (qkv, o, gate_up, down) and a narrow LM head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576)]
#: rows per call: the GEMV, every remainder of the 6-row register tile, decode batches, the cap
ROWS = [1, 2, 5, 6, 7, 13, 64, 200, MAX_ROWS]


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    k = CpuKernels.load()
    assert k is not None
    return k


def _activations(g: torch.Generator, m: int, k: int) -> torch.Tensor:
    """Fresh rows like the model's, some large."""
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    return x.to(torch.bfloat16)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_kernel_is_the_gemm_row_for_row_at_every_batch_size(kernels, n, k) -> None:
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    blocks: dict[tuple[int, int], int | None] = {}
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    op = packed_bf16_linear(kernels, packed, w, None, 64, blocks)
    if not kernels.has_bf16_dot:
        assert op is None and blocks == {}
        return
    assert op is not None and blocks[(n, k)] == op.k_block
    for m in ROWS:
        x = _activations(g, m, k)
        want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        assert torch.equal(op(x), want), f"{m} rows"
    # a batch's rows one at a time (the GEMV) give the same bits as the batch (the GEMM)
    x = _activations(g, 24, k)
    assert torch.equal(torch.cat([op(x[i:i + 1]) for i in range(24)]), op(x))
    # and close to the exact product (a matrix product, not just a copy)
    torch.testing.assert_close(op(x).float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-2)


def test_packed_linear_routes_up_to_max_rows_to_the_kernel(kernels) -> None:
    w = torch.randn(960, 576).to(torch.bfloat16)
    blocks: dict[tuple[int, int], int | None] = {}
    fn = packed_linear(w, None, 64, lambda p, wt, b: packed_bf16_linear(kernels, p, wt, b, 64,
                                                                          blocks))
    assert fn is not None
    own = getattr(fn, "kernel", None)
    assert (own is not None) == kernels.has_bf16_dot
    calls: list[int] = []
    if own is not None:
        real = own.kernels.linear_bf16_packed_unchecked

        def counting(*args):
            calls.append(args[3])
            return real(*args)

        own.kernels = type("K", (), {"linear_bf16_packed_unchecked": staticmethod(counting)})()
    x = torch.randn(MAX_ROWS + 20, 576).to(torch.bfloat16)
    whole = fn(x)  # past the cap: oneDNN
    parts = torch.cat([fn(x[:1]), fn(x[1:7]), fn(x[7:])])  # the kernel, the kernel, oneDNN
    assert torch.equal(parts, whole)
    if own is not None:
        assert calls == [1, 6]  # the oneDNN calls never reached the kernel


def test_kernel_declines_what_it_cannot_reproduce(kernels) -> None:
    blocks: dict[tuple[int, int], int | None] = {}
    mk = torch.ops.mkldnn
    w = torch.randn(960, 576).to(torch.bfloat16)
    bias = torch.randn(960).to(torch.bfloat16)
    assert packed_bf16_linear(kernels, mk._reorder_linear_weight(w, 64), w, bias, 64,
                              blocks) is None
    w32 = torch.randn(960, 576)
    assert packed_bf16_linear(kernels, mk._reorder_linear_weight(w32, 64), w32, None, 64,
                              blocks) is None
    odd = torch.randn(100, 576).to(torch.bfloat16)  # N not a multiple of 64
    assert packed_bf16_linear(kernels, mk._reorder_linear_weight(odd, 64), odd, None, 64,
                              blocks) is None
    assert packed_bf16_linear(None, mk._reorder_linear_weight(w, 64), w, None, 64,
                              blocks) is None
    assert blocks == {}


@pytest.mark.parametrize("rows", [1, 64])
def test_wrong_k_blocking_is_caught(kernels, rows) -> None:
    """The probe is what makes the fast path safe: a K blocking other than oneDNN's changes
    some rows' bits, in the GEMV and in the GEMM, and ``find_k_block`` must notice it."""
    if not kernels.has_bf16_dot:
        with pytest.raises(RuntimeError, match="code 5"):
            kernels.linear_bf16_packed(torch.zeros(rows, 576, dtype=torch.bfloat16), 0,
                                       torch.empty(rows, 64, dtype=torch.bfloat16), 512)
        return
    kb = find_k_block(kernels, 3072, 576, 64)
    assert kb is not None
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3072, 576, generator=g).to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    x = torch.randn(256, 576, generator=g).to(torch.bfloat16)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    ptr = torch.ops.mkldnn.data_ptr(packed)
    out = torch.empty(rows, 3072, dtype=torch.bfloat16)
    wrong = 576 if kb != 576 else 64
    differs = 0
    for i in range(0, 256, rows):
        kernels.linear_bf16_packed(x[i:i + rows], ptr, out, wrong)
        differs += int((out != want[i:i + rows]).sum())
    assert differs > 0
