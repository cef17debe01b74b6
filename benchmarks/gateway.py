"""Figures for docs/benchmarks.md's "Behind the smg gateway" section, with
``radixserve bench serve`` (it measures any OpenAI server) against real processes on free
127.0.0.1 ports.

    .venv/bin/python benchmarks/gateway.py serve  --out docs/benchmarks  [--levels 1,16,64]
    .venv/bin/python benchmarks/gateway.py prefix --out docs/benchmarks

* ``serve``: throughput, TTFT and ITL at each concurrency level, (a) straight to
  ``radixserve serve`` (HTTP), (b) through ``smg launch`` to one ``radixserve serve --grpc``
  worker with the same engine flags, (c) through ``radixserve fleet --workers 2`` (one core
  each), (d) through smg to one headless ``radixserve serve --zmq-worker`` engine core
  (vLLM's EngineCore wire), (e) ``radixserve fleet --wire zmq --workers 2``. Writes
  ``gateway-serve-{direct,smg,fleet,smg-zmq,fleet-zmq}.json``; ``--setups`` picks some.
* ``prefix``: the shared-prefix set (4 groups x 8 requests, 400-token group prefix,
  concurrency 8) through smg over two workers, ``cache_aware`` then ``round_robin`` (caches
  flushed in between); prefix-cache hit rate from the workers' own counters and from the
  responses' ``cached_tokens``. Writes ``gateway-prefix.json``.

Engine flags for every worker/server come after ``--`` (default: ``--num-pages 2048``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port(n: int = 1) -> int:
    """The first of ``n`` consecutive free ports."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue


def wait(url: str, proc: subprocess.Popen, ok=lambda r: True, timeout_s: float = 600) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:3]} exited with {proc.returncode}")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200 and ok(r):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} not ready")


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.wait(60)


def smg(worker_urls: list[str], policy: str = "round_robin") -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen([str(BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
                          "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                          "--worker-urls", *worker_urls, "--policy", policy,
                          "--health-check-interval-secs", "1", "--log-level", "warn",
                          "--worker-startup-check-interval", "1",
                          "--shutdown-grace-period-secs", "1"], env=ENV,
                         stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait(url + "/readiness", p, lambda r: r.json().get("healthy_workers") == len(worker_urls))
    return p, url


def grpc_worker(args: list[str]) -> tuple[subprocess.Popen, str, str]:
    port, metrics = free_port(), free_port()
    p = subprocess.Popen([str(BIN / "radixserve"), "serve", "--grpc", "--port", str(port),
                          "--metrics-port", str(metrics), "--log-level", "warning", *args],
                         env=ENV)
    wait(f"http://127.0.0.1:{metrics}/health", p)
    return p, f"grpc://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}"


def zmq_worker(args: list[str]) -> tuple[subprocess.Popen, subprocess.Popen, str]:
    """A ``--zmq-worker`` engine core and smg (``--backend vllm``, the model's folder aliased
    to its name) over it: (worker, smg, smg's URL). Also used by
    ``frontend_cpu_per_token.py``."""
    from radixserve.entrypoints.fleet import check_worker_args
    from radixserve.model_executor.loader import resolve_model

    files = resolve_model(check_worker_args(args)[1].model)
    folder = str(files.folder)
    url = f"ipc://{tempfile.mkdtemp(prefix='rs-gw-')}/engine"
    w = subprocess.Popen([str(BIN / "radixserve"), "serve", "--zmq-worker", url,
                          "--log-level", "warning", *args], env=ENV)
    port = free_port()
    g = subprocess.Popen([str(BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
                          "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                          "--worker-urls", url, "--backend", "vllm", "--model-path", folder,
                          "--model-alias", f"{files.name}={folder}",
                          "--policy", "round_robin", "--health-check-interval-secs", "1",
                          "--log-level", "warn", "--shutdown-grace-period-secs", "1"],
                         env=ENV, stdout=subprocess.DEVNULL)
    gurl = f"http://127.0.0.1:{port}"
    wait(gurl + "/readiness", g, lambda r: r.json().get("healthy_workers") == 1)
    return w, g, gurl


def bench(url: str, out: Path, extra: list[str]) -> dict:
    subprocess.run([str(BIN / "radixserve"), "bench", "serve", "--base-url", url,
                    "--disable-tqdm", "--json", str(out), *extra], env=ENV, check=True)
    return json.loads(out.read_text())


def cmd_serve(ns: argparse.Namespace, args: list[str]) -> None:
    load = ["--endpoint", "completions", "--num-prompts", str(ns.num_prompts),
            "--random-input-len", "128", "--random-output-len", "64",
            "--sweep-concurrency", ns.levels]
    out = Path(ns.out)
    setups = ns.setups.split(",")
    if "direct" in setups:
        port = free_port()
        http = subprocess.Popen([str(BIN / "radixserve"), "serve", "--port", str(port),
                                 "--log-level", "warning", *args], env=ENV)
        try:
            wait(f"http://127.0.0.1:{port}/health", http)
            bench(f"http://127.0.0.1:{port}", out / "gateway-serve-direct.json",
                  [*load, "--label", "direct (HTTP)"])
        finally:
            stop(http)
    if "smg" in setups:
        w, wurl, _ = grpc_worker(args)
        try:
            g, gurl = smg([wurl])
            try:
                bench(gurl, out / "gateway-serve-smg.json",
                      [*load, "--label", "smg + 1 gRPC worker"])
            finally:
                stop(g)
        finally:
            stop(w)
    if "smg-zmq" in setups:
        w, g, gurl = zmq_worker(args)
        try:
            bench(gurl, out / "gateway-serve-smg-zmq.json",
                  [*load, "--label", "smg + 1 ZMQ worker (headless engine core)"])
        finally:
            stop(g, w)
    for wire in ("grpc", "zmq"):
        name = "fleet" if wire == "grpc" else "fleet-zmq"
        if name not in setups:
            continue
        port, base = free_port(), free_port(4)
        fleet = subprocess.Popen([str(BIN / "radixserve"), "fleet", "--wire", wire,
                                  "--workers", "2", "--port", str(port),
                                  "--prometheus-port", str(free_port()),
                                  "--worker-base-port", str(base), "--policy", "cache_aware",
                                  "--smg-arg=--log-level warn", "--", *args], env=ENV)
        try:
            wait(f"http://127.0.0.1:{port}/readiness", fleet,
                 lambda r: r.json().get("healthy_workers") == 2)
            bench(f"http://127.0.0.1:{port}", out / f"gateway-serve-{name}.json",
                  [*load, "--label", f"smg + fleet of 2 {wire} workers (1 core each)"])
        finally:
            stop(fleet)


def _counters(metrics_urls: list[str]) -> dict[str, float]:
    out = {"hits": 0.0, "queries": 0.0}
    for u in metrics_urls:
        for line in httpx.get(u + "/metrics", timeout=10).text.splitlines():
            if line.startswith("radixserve:prefix_cache_hits_total"):
                out["hits"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("radixserve:prefix_cache_queries_total"):
                out["queries"] += float(line.rsplit(" ", 1)[1])
    return out


def cmd_prefix(ns: argparse.Namespace, args: list[str]) -> None:
    workers = [grpc_worker(args) for _ in range(2)]
    urls, metrics = [w[1] for w in workers], [w[2] for w in workers]
    load = ["--endpoint", "completions", "--dataset-name", "shared-prefix",
            "--shared-prefix-groups", "4", "--shared-prefix-prompts-per-group", "8",
            "--shared-prefix-len", "400", "--shared-prefix-question-len", "16",
            "--shared-prefix-output-len", "4", "--max-concurrency", "8", "--num-warmups", "0"]
    result: dict = {"workers": 2, "engine_args": args, "loadavg_1m": os.getloadavg()[0]}
    try:
        for i, policy in enumerate(("cache_aware", "round_robin")):
            g, gurl = smg(urls, policy)
            try:
                httpx.post(gurl + "/flush_cache", timeout=30).raise_for_status()
                time.sleep(0.5)
                before = _counters(metrics)
                doc = bench(gurl, Path(ns.out) / f"gateway-prefix-{policy}.json",
                            [*load, "--seed", str(100 + i), "--label", policy])
                after = _counters(metrics)
                hits, queries = after["hits"] - before["hits"], after["queries"] - before["queries"]
                run = doc["runs"][0]
                result[policy] = {"prefix_hit_tokens": hits, "prefix_queried_tokens": queries,
                                  "hit_rate": hits / queries if queries else None,
                                  "cached_prompt_tokens": run.get("cached_prompt_tokens"),
                                  "cached_prompt_fraction": run.get("cached_prompt_fraction")}
                print(policy, result[policy], flush=True)
            finally:
                stop(g)
    finally:
        stop(*(w[0] for w in workers))
    (Path(ns.out) / "gateway-prefix.json").write_text(json.dumps(result, indent=1) + "\n")


def main() -> int:
    argv = sys.argv[1:]
    args = argv[argv.index("--") + 1:] if "--" in argv else ["--num-pages", "2048"]
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["serve", "prefix"])
    p.add_argument("--out", default="docs/benchmarks")
    p.add_argument("--levels", default="1,16,64")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--setups", default="direct,smg,fleet,smg-zmq,fleet-zmq",
                   help="serve: which of direct, smg, fleet, smg-zmq, fleet-zmq to run")
    ns = p.parse_args(argv)
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    {"serve": cmd_serve, "prefix": cmd_prefix}[ns.what](ns, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
