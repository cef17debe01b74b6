"""The benchmark commands at tiny sizes: each runs end to end and writes JSON with every key the
docs promise. Figures are never asserted (they depend on the machine and its load)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess, free_port

from radixserve.cli import main

PHASES = {"schedule", "prepare", "output", "transport", "total"}
LATENCY_KEYS = {f"{stat}_{metric}_ms" for stat in ("mean", "median", "p90", "p99")
                for metric in ("ttft", "tpot", "itl", "e2el")}
SERVE_KEYS = {"completed", "failed", "duration", "request_throughput", "output_throughput",
              "total_token_throughput", "total_input_tokens", "total_output_tokens",
              "cached_prompt_tokens", "max_concurrency", "request_rate"} | LATENCY_KEYS


def _png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_overhead_null_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, png = tmp_path / "overhead.json", tmp_path / "overhead.png"
    assert main(["bench", "overhead", "--batch-sizes", "1,4", "--steps", "5", "--warmup", "2",
                 "--prompt-len", "16", "--prefill-len", "32", "--json", str(out),
                 "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert {(r["batch_size"], r["mode"]) for r in rows} == {
        (1, "decode"), (4, "decode"), (1, "mixed"), (4, "mixed")}
    for r in rows:
        assert set(r["us_per_step"]) >= PHASES
        assert all(isinstance(v, float) and v >= 0 for v in r["us_per_step"].values())
    assert {"cpu", "cores", "date"} <= set(doc["machine"])
    assert _png(png)
    assert "transport" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_offline_default_model(tmp_path: Path) -> None:
    out, png = tmp_path / "offline.json", tmp_path / "offline.png"
    assert main(["bench", "offline", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "8", "--step-timers", "--num-pages", "64", "--json", str(out),
                 "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    rs = doc["radixserve"]
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "wall_s"):
        assert rs[key] > 0
    assert rs["output_tokens"] == 16  # ignore_eos by default: every prompt runs to its length
    timers = rs["extra"]["step_timers_ms"]
    assert set(timers) >= {"schedule", "prepare", "forward", "output"}
    assert _png(png)


@pytest.mark.slow
def test_bench_serve_random_completions(server: ServerProcess, tmp_path: Path) -> None:
    """Against the session's shared default-model server (started with --step-timers)."""
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "3",
                 "--random-input-len", "16", "--random-output-len", "4",
                 "--max-concurrency", "2", "--disable-tqdm", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert set(run) >= SERVE_KEYS
    assert run["completed"] == 3 and run["failed"] == 0
    assert run["total_output_tokens"] == 12  # ignore_eos is sent by default
    # the engine's step timers reach /metrics as Prometheus histograms
    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    for phase in ("schedule", "prepare", "forward", "output"):
        counts = [line for line in metrics.splitlines()
                  if line.startswith(f"radixserve:step_{phase}_seconds_count")]
        assert counts and float(counts[0].split()[-1]) > 0, phase


@pytest.mark.slow
def test_bench_serve_shared_prefix_chat_sweep(server: ServerProcess, tmp_path: Path) -> None:
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    assert main(["bench", "serve", "--base-url", server.base_url, "--endpoint", "chat",
                 "--dataset-name", "shared-prefix", "--shared-prefix-groups", "1",
                 "--shared-prefix-prompts-per-group", "3", "--shared-prefix-len", "48",
                 "--shared-prefix-question-len", "8", "--shared-prefix-output-len", "3",
                 "--sweep-concurrency", "1,2", "--request-rate", "50", "--disable-tqdm",
                 "--json", str(out), "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert [r["max_concurrency"] for r in doc["runs"]] == [1, 2]
    for run in doc["runs"]:
        assert set(run) >= SERVE_KEYS
        assert run["completed"] == 3 and run["failed"] == 0
    assert _png(png)


def test_bench_serve_reports_unreachable_server(capsys: pytest.CaptureFixture) -> None:
    port = free_port()  # nothing listens there
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1",
               "--random-input-len", "4", "--random-output-len", "2", "--disable-tqdm"])
    assert rc == 2
    assert "cannot list models" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_prefix_ttft(tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix", "--prefix-len", "64", "--suffix-len", "8", "--repeats", "2",
                 "--num-pages", "64", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    for key in ("prefix_len", "suffix_len", "ttft_cached_s", "ttft_uncached_s", "speedup",
                "cached_tokens", "samples_cached_s", "samples_uncached_s", "model", "dtype"):
        assert key in res, key
    # the prefix really was served from the cache (whole pages of it)
    assert all(n >= 64 - 16 for n in res["cached_tokens"])
    assert len(res["samples_cached_s"]) == 2


def test_torch_compile_ab_script_compares_paths_on_the_same_keys() -> None:
    """``benchmarks/torch_compile_ab.py`` (docs/benchmarks.md, "Findings") at a tiny size,
    without its compiled paths (tens of seconds of Inductor): the reference and radixserve's
    path decode over the same prefilled K/V, so in float32 their logits agree closely (a page
    table or slot mapping pointing elsewhere would not)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks/torch_compile_ab.py"),
                          "--dtype", "float32", "--batch", "3", "--context", "21",
                          "--repeats", "1", "--paths", "eager,radixserve"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    assert (doc["batch"], doc["context"]) == (3, 21)
    paths = doc["paths"]
    assert set(paths) == {"eager", "radixserve"}
    for p in paths.values():
        assert p["best_ms"] > 0 and p["median_ms"] >= p["best_ms"]
    assert paths["eager"]["max_abs_diff"] == 0.0
    assert paths["radixserve"]["max_abs_diff"] < 1e-3
    assert paths["radixserve"]["paths"]["decode_layers"] in ("fused", "per-op")
