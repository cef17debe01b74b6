"""radixserve's linear kernel over oneDNN's packed weights (bf16 and float32): where the CPU has
the instructions, every row must get exactly the bits oneDNN's GEMM gives it in any batch (the
engine's batch invariance rests on it); elsewhere oneDNN must stay."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.layers.linear import packed_linear
from radixserve.model_executor.layers.packed_kernel import (
    MAX_ROWS,
    find_k_block,
    max_rows_for,
    packed_kernel_linear,
)

#: SmolLM2-135M's projections (qkv, o, gate_up, down) and a narrow LM head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (4096, 576)]
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def kernels(kernel_build: str) -> CpuKernels:
    k = CpuKernels.load(kernel_build)
    assert k is not None
    return k


def _not_on_amx_bf16(kernels: CpuKernels, dtype: torch.dtype) -> None:
    """The AMX kind runs oneDNN's bf16 GEMM on AMX tiles, whose sums this kernel (ordered
    ``vdpbf16ps`` chains) cannot reproduce: there bf16 linears run radixserve's AMX GEMM
    (tests/unit/test_amx_kernel.py), and these tests of reproducing oneDNN do not apply."""
    if dtype == torch.bfloat16 and kernels.amx.available:
        pytest.skip("AMX kind: bf16 linears run radixserve's AMX GEMM, not this kernel "
                    "(oneDNN's tile sums are not reproducible); see test_amx_kernel.py")


def _rows() -> list[int]:
    """The GEMV, every remainder of the 6-row register tile, decode batches, and up to the
    largest cap the start-up measurement can pick (``path_choice.KERNEL_ROWS``), whatever
    this build's default cap"""
    return [1, 2, 5, 6, 7, 13, 64, 200, MAX_ROWS]


def _activations(g: torch.Generator, m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Fresh rows like the model's, some large."""
    return (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_kernel_is_the_gemm_row_for_row_at_every_batch_size(kernels, n, k, dtype) -> None:
    _not_on_amx_bf16(kernels, dtype)
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    blocks: dict[tuple[int, int], int | None] = {}
    if not kernels.has_linear_kernel(dtype):
        # declined before looking at the layout (oneDNN may not even pack bf16 on this CPU)
        assert packed_kernel_linear(kernels, w, w, None, 64, blocks) is None and blocks == {}
        return
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    op = packed_kernel_linear(kernels, packed, w, None, 64, blocks, max_rows=MAX_ROWS)
    assert op is not None and blocks[(n, k)] == op.k_block
    for m in _rows():
        x = _activations(g, m, k, dtype)
        want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        if m > 1:  # oneDNN's own one-row path rounds otherwise: that is why the kernel exists
            assert torch.equal(op(x), want), f"{m} rows"
    # a batch's rows one at a time give the same bits as the batch
    x = _activations(g, 24, k, dtype)
    assert torch.equal(torch.cat([op(x[i:i + 1]) for i in range(24)]), op(x))
    # and close to the exact product (a matrix product, not just a copy)
    torch.testing.assert_close(op(x).float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap", [None, 32])
def test_packed_linear_routes_up_to_max_rows_to_the_kernel(kernels, dtype, cap) -> None:
    """``cap`` None: the build's default rule; 32: a cap measured at start-up."""
    _not_on_amx_bf16(kernels, dtype)
    w = torch.randn(960, 576).to(dtype)
    blocks: dict[tuple[int, int], int | None] = {}
    fn = packed_linear(w, None, 64, lambda p, wt, b: packed_kernel_linear(kernels, p, wt, b, 64,
                                                                            blocks, cap))
    if fn is None:  # oneDNN cannot pack this dtype on this CPU (bf16 without AVX-512)
        assert not kernels.has_linear_kernel(dtype)
        return
    own = getattr(fn, "kernel", None)
    assert (own is not None) == kernels.has_linear_kernel(dtype)
    cap = max_rows_for(kernels, dtype) if cap is None else cap
    assert own is None or own.max_rows == cap
    calls: list[int] = []
    if own is not None:
        real = own.kernels.linear_packed_unchecked

        def counting(*args):
            calls.append(args[4])
            return real(*args)

        own.kernels = type("K", (), {"linear_packed_unchecked": staticmethod(counting)})()
    x = torch.randn(cap + 20, 576).to(dtype)
    whole = fn(x)  # past the cap: oneDNN
    parts = torch.cat([fn(x[:1]), fn(x[1:7]), fn(x[7:])])  # the kernel, the kernel, oneDNN
    assert torch.equal(parts, whole)
    if own is not None:
        assert calls == [1, 6]  # the oneDNN calls never reached the kernel


def test_kernel_declines_what_it_cannot_reproduce(kernels) -> None:
    blocks: dict[tuple[int, int], int | None] = {}
    mk = torch.ops.mkldnn
    w = torch.randn(960, 576)
    bias = torch.randn(960)
    assert packed_kernel_linear(kernels, mk._reorder_linear_weight(w, 64), w, bias, 64,
                                blocks) is None
    w16 = torch.randn(960, 576).to(torch.float16)
    assert packed_kernel_linear(kernels, w16, w16, None, 64, blocks) is None
    odd = torch.randn(100, 576)  # N not a multiple of 64
    assert packed_kernel_linear(kernels, mk._reorder_linear_weight(odd, 64), odd, None, 64,
                                blocks) is None
    assert packed_kernel_linear(None, mk._reorder_linear_weight(w, 64), w, None, 64,
                                blocks) is None
    assert blocks == {}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 6])
def test_wrong_k_blocking_is_caught(kernels, rows, dtype) -> None:
    """The probe is what makes the fast path safe: a K blocking other than oneDNN's changes
    some rows' bits, and ``find_k_block`` must notice it."""
    _not_on_amx_bf16(kernels, dtype)
    if not kernels.has_linear_kernel(dtype):
        with pytest.raises(RuntimeError, match="code 5"):
            kernels.linear_packed(torch.zeros(rows, 576, dtype=dtype), 0,
                                  torch.empty(rows, 64, dtype=dtype), 512)
        return
    kb = find_k_block(kernels, 3072, 576, 64, dtype)
    assert kb is not None
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3072, 576, generator=g).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    x = torch.randn(256, 576, generator=g).to(dtype)
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    ptr = torch.ops.mkldnn.data_ptr(packed)
    out = torch.empty(rows, 3072, dtype=dtype)
    wrong = 576 if kb != 576 else 64
    differs = 0
    for i in range(0, 252 if rows > 1 else 256, rows):
        kernels.linear_packed(x[i:i + rows], ptr, out, wrong)
        if rows > 1:
            differs += int((out != want[i:i + rows]).sum())
        else:  # one row: against the kernel's own right blocking
            right = torch.empty_like(out)
            kernels.linear_packed(x[i:i + 1], ptr, right, kb)
            differs += int((out != right).sum())
    assert differs > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_bits_do_not_depend_on_the_thread_count(kernels, dtype) -> None:
    """Threads take equal shares of panels x row tiles, which may end inside a panel (a 576-
    output weight has 9 blocks): every share gives oneDNN's bits, whatever the thread count."""
    _not_on_amx_bf16(kernels, dtype)
    if not kernels.has_linear_kernel(dtype):  # not built: it says so, whatever the threads
        with pytest.raises(RuntimeError, match="code 5"):
            kernels.linear_packed(torch.zeros(7, 1536, dtype=dtype), 0,
                                  torch.empty(7, 576, dtype=dtype), 512)
        return
    n, k = 576, 1536
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    kb = find_k_block(kernels, n, k, 64, dtype)
    assert kb is not None
    ptr = torch.ops.mkldnn.data_ptr(packed)
    before = torch.get_num_threads()
    try:
        for m in (2, 7, 13, 64, 100):
            x = _activations(g, m, k, dtype)
            want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            for threads in (1, 2, 3, 5):
                torch.set_num_threads(threads)
                out = torch.full((m, n), float("nan"), dtype=dtype)  # every element written
                kernels.linear_packed(x, ptr, out, kb)
                assert torch.equal(out, want), f"{m} rows, {threads} threads"
    finally:
        torch.set_num_threads(before)
