"""The measured choice between packed and dense linears, and its per-machine cache."""

from __future__ import annotations

import torch

from radixserve.model_executor import path_choice
from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.path_choice import choose_linear_path


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, 64, generator=g) for n in (96, 64, 256)]


def test_measures_once_then_reads_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    first = choose_linear_path(_weights(), 16, "tiny float32")
    assert not first.cached
    if first.seconds:  # packing available in this torch build: both paths were timed
        assert set(first.seconds) == {"packed", "dense"}
        assert all(len(v) == len(path_choice.MEASURE_M) for v in first.seconds.values())
        speedup = path_choice.packed_speedup(first.seconds)
        assert first.path == ("packed" if speedup > 1 else "dense")
        assert "measured" in first.reason
    calls = []
    monkeypatch.setattr(path_choice, "measure", lambda *a: calls.append(a))
    again = choose_linear_path(_weights(), 16, "tiny float32")
    if first.seconds:
        assert again.cached and again.path == first.path and not calls
    # another model's shapes are another entry: measured again
    choose_linear_path(_weights(), 16, "other model")
    assert len(calls) == 1


def test_packed_speedup_weighs_ratios_not_sums() -> None:
    n = len(path_choice.MEASURE_M)
    # packed 2x faster at every M but the largest, where it is 1.5x slower: packed wins,
    # although the summed seconds would say dense
    packed = [1.0] * (n - 1) + [150.0]
    dense = [2.0] * (n - 1) + [100.0]
    assert sum(packed) > sum(dense)
    assert path_choice.packed_speedup({"packed": packed, "dense": dense}) > 1.0
    assert path_choice.packed_speedup({"packed": dense, "dense": packed}) < 1.0


def test_a_corrupt_cache_file_is_measured_again(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    choose_linear_path(_weights(), 16, "k")
    files = list(tmp_path.rglob("linear-*.json"))
    if not files:
        return  # packing unavailable: nothing is cached
    files[0].write_text("{not json")
    got = choose_linear_path(_weights(), 16, "k")
    assert not got.cached and got.path in ("packed", "dense")


def test_kernel_max_rows_is_the_last_row_count_before_the_first_loss() -> None:
    rows = path_choice.KERNEL_ROWS
    n = len(rows)
    onednn = [1.0] * n
    assert path_choice.kernel_max_rows({"radixserve": [0.9] * n, "onednn": onednn}) == rows[-1]
    # slower at the third row count: the second, although it wins again later
    ours = [0.9, 0.9, 1.1] + [0.9] * (n - 3)
    assert path_choice.kernel_max_rows({"radixserve": ours, "onednn": onednn}) == rows[1]
    # a measurement that stopped at its first loss
    assert path_choice.kernel_max_rows({"radixserve": [0.9, 1.2],
                                        "onednn": [1.0, 1.0]}) == rows[0]
    # slower from the first: the floor
    assert path_choice.kernel_max_rows({"radixserve": [1.1], "onednn": [1.0]}) == rows[0]
    # a tie keeps the kernel (the same bits either way)
    assert path_choice.kernel_max_rows({"radixserve": [1.0] * n, "onednn": onednn}) == rows[-1]


def test_kernel_rows_measured_once_then_cached(tmp_path, monkeypatch,
                                              seed_kernel_cache) -> None:
    seed_kernel_cache(tmp_path)
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    kernels = CpuKernels.load()
    # both CPU kinds have AVX2 + FMA: the float32 kernel is built on either
    assert kernels is not None and kernels.has_linear_kernel(torch.float32)
    shapes = [(128, 64), (64, 256)]
    blocks: dict[tuple[int, int], int | None] = {}
    first = path_choice.choose_kernel_rows(kernels, torch.float32, shapes, 16, blocks, "tiny")
    assert first is not None and not first.cached
    assert set(blocks) == set(shapes) and all(kb is not None for kb in blocks.values())
    ours, onednn = first.seconds["radixserve"], first.seconds["onednn"]
    assert 1 <= len(ours) == len(onednn) <= len(path_choice.KERNEL_ROWS)
    # the measurement ran to the end or stopped at the kernel's first loss
    assert len(ours) == len(path_choice.KERNEL_ROWS) or ours[-1] > onednn[-1]
    assert first.max_rows == path_choice.kernel_max_rows(first.seconds)
    assert f"up to {first.max_rows} rows" in first.reason
    calls = []
    monkeypatch.setattr(path_choice, "measure_kernel_rows", lambda *a: calls.append(a))
    again = path_choice.choose_kernel_rows(kernels, torch.float32, shapes, 16, {}, "tiny")
    assert again.cached and again.max_rows == first.max_rows and not calls
    # another kernel build (new source or flags) is measured again
    monkeypatch.setattr(kernels, "build_id", "cpu_kernels-other.so")
    assert path_choice.choose_kernel_rows(kernels, torch.float32, shapes, 16, {},
                                          "tiny") is None
    assert len(calls) == 1
    # as is a corrupt cache file
    monkeypatch.undo()
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    for f in tmp_path.rglob("kernel-rows-*.json"):
        f.write_text("{not json")
    got = path_choice.choose_kernel_rows(kernels, torch.float32, shapes, 16, {}, "tiny")
    assert not got.cached and got.max_rows in path_choice.KERNEL_ROWS


def test_the_dense_form_of_a_gguf_is_timed_through_the_served_linear() -> None:
    """The GGUF form measurement times the dense form through the linear a dense model is
    served with: radixserve's kernel for a one-row call where this build has it (oneDNN's
    matrix-vector speed would make the dense form look slow at one row), AMX where it runs;
    every path gives the product."""
    kernels = CpuKernels.load()
    assert kernels is not None
    g = torch.Generator().manual_seed(0)
    # a shape whose float32 K blocking the kernel reproduces on every kind (as above)
    w = torch.randn(64, 256, generator=g)
    x = torch.randn(3, 256, generator=g)
    fn = path_choice.dense_form_linear(kernels, w, 16, {})
    # both CPU kinds have AVX2 + FMA: the float32 kernel takes the decode-sized calls
    assert kernels.has_linear_kernel(torch.float32) and hasattr(fn, "kernel")
    assert fn.kernel.max_rows >= 1
    torch.testing.assert_close(fn(x), x @ w.T, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fn(x[:1]), x[:1] @ w.T, rtol=1e-4, atol=1e-4)
    wb, xb = w.to(torch.bfloat16), x.to(torch.bfloat16)
    fb = path_choice.dense_form_linear(kernels, wb, 16, {})
    if kernels.amx.available and kernels.amx.self_check()[0]:
        assert type(fb).__name__ == "AmxLinear"
    torch.testing.assert_close(fb(xb).float(), (xb.float() @ wb.float().T), rtol=2e-2,
                               atol=5e-2)
