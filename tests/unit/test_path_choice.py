"""The measured choice between packed and dense linears, and its per-machine cache."""

from __future__ import annotations

import torch

from radixserve.model_executor import path_choice
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
