"""radixserve's AMX bfloat16 GEMM (``kernels/amx.py``, ``csrc/amx_kernels.c``): the packed tile
layout and one reduction order per output for every row count (the model's linears on it:
tests/integration/test_amx_linears.py).

On every CPU the kernel's scalar emulation of the tile instruction runs the same loops over the
same layout (``emulate=True``, and the default where the CPU has no AMX): that checks the
packing, the padding of N and K, the blocking and batch invariance anywhere. The tile
instructions themselves run only where ``amx_bf16`` is present; those tests say so when
skipped."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_executor.kernels.cpu import CpuKernels


@pytest.fixture(scope="module")
def kernels(kernel_build: str) -> CpuKernels:
    k = CpuKernels.load(kernel_build)
    assert k is not None
    return k


def _on_amx(kernels: CpuKernels) -> None:
    if not kernels.amx.available:
        pytest.skip("no AMX here (amx_bf16 and amx_tile in /proc/cpuinfo, and Linux granting "
                    "the tile state): the tile instructions run on the AMX kind only")


#: (N, K): aligned, N and K both padded, a real layer's shapes
SHAPES = [(64, 32), (100, 70), (576, 576), (130, 1536)]


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_emulated_tiles_compute_the_product_batch_invariantly(kernels, n, k) -> None:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(37, k, generator=g).bfloat16()
    packed = kernels.amx.pack(w)
    assert packed.numel() == -(-n // 64) * 64 * -(-k // 32) * 32
    y = kernels.amx.linear(x, packed, n, emulate=True)
    ref = x.float() @ w.float().T
    # the float32 sum rounded once to bfloat16 (2^-8 relative), plus summation-order noise
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    alone = torch.cat([kernels.amx.linear(x[i:i + 1].contiguous(), packed, n, emulate=True)
                       for i in range(37)])
    assert torch.equal(alone, y), "a row's bits depend on the rows beside it"
    assert torch.equal(kernels.amx.linear(x[5:21].contiguous(), packed, n, emulate=True),
                       y[5:21])


def test_emulated_bits_do_not_depend_on_the_thread_count(kernels) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(576, 1536, generator=g).bfloat16()
    x = torch.randn(21, 1536, generator=g).bfloat16()
    packed = kernels.amx.pack(w)
    old = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(kernels.amx.linear(x, packed, 576, emulate=True))
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_bad_input_is_refused(kernels) -> None:
    amx = kernels.amx
    with pytest.raises(ValueError, match="bfloat16"):
        amx.pack(torch.zeros(64, 32))
    packed = amx.pack(torch.zeros(64, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="tile layout"):
        amx.linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, 64)
    with pytest.raises(ValueError, match="bfloat16"):
        amx.linear(torch.zeros(2, 32), packed, 64)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_tiles_on_the_amx_kind(kernels, n, k) -> None:
    """The hardware's tile sums: close to oneDNN's GEMM, every row the same bits alone and in
    any batch (1 row, tile remainders, a prefill-sized call), whatever the thread count."""
    _on_amx(kernels)
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    packed = kernels.amx.pack(w)
    x = torch.randn(300, k, generator=g).bfloat16()
    y = kernels.amx.linear(x, packed, n)
    ref = torch.nn.functional.linear(x, w)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for m in (1, 2, 15, 16, 17, 64):
        assert torch.equal(kernels.amx.linear(x[:m].contiguous(), packed, n), y[:m]), m
    assert torch.equal(torch.cat([kernels.amx.linear(x[i:i + 1].contiguous(), packed, n)
                                  for i in range(40)]), y[:40])
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.amx.linear(x, packed, n), y)
    finally:
        torch.set_num_threads(old)
    # the emulation follows the instruction's pseudo-code; the hardware may round inside a
    # pair differently, so the two agree to bfloat16 rounding, not to the bit
    torch.testing.assert_close(kernels.amx.linear(x, packed, n, emulate=True).float(),
                               y.float(), rtol=1e-2, atol=1e-2)


def test_self_check_decides_whether_the_tiles_serve(kernels) -> None:
    """The engine asks ``self_check`` before serving on the tiles: off the AMX kind it says no
    and why; on it, the probe must pass (a failure is a kernel bug, and the engine keeps
    oneDNN)."""
    ok, why = kernels.amx.self_check()
    assert ok == kernels.amx.available, why
    assert why
    if not ok:
        assert "AMX" in why
