"""Frontend CPU time per streamed token, measured against a null-model server.

Starts ``radixserve serve --null-model`` (the engine returns a fixed token instantly, so the
frontend's own work is all that is left: ZMQ receive + decode, per-request queues, incremental
detokenization, JSON encoding, SSE writes), streams ``--concurrency`` completions of
``--max-tokens`` tokens each, and reads the frontend's and the engine core's CPU time
(user + system, from /proc) before and after.

With ``--frontend smg`` the frontend is the smg gateway (``smg launch``, Rust: HTTP,
tokenization, detokenization, SSE) in front of ``radixserve serve --grpc --null-model`` (the
gRPC worker: protobuf in and out, the same engine client and output processor); the frontend
CPU is then smg's plus the worker process's (both are also reported on their own). With
``--frontend smg-zmq`` smg drives ``radixserve serve --zmq-worker --null-model`` directly over
vLLM's EngineCore ZMQ wire: no Python frontend at all, the frontend CPU is smg's alone and the
engine core (the worker's only process) is reported as the engine.

    .venv/bin/python benchmarks/frontend_cpu_per_token.py --concurrency 1 16 64 --max-tokens 2000
    .venv/bin/python benchmarks/frontend_cpu_per_token.py --frontend http smg --concurrency 64

Prints one JSON object per frontend and concurrency level: tokens streamed, SSE chunks (a
frontend that falls behind sends several tokens per chunk), wall seconds, tokens/s, and CPU
microseconds per streamed token for the frontend and for the engine core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from radixserve.bench.ports import free_ports

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


MODEL = "SmolLM2-135M-Instruct"


async def stream_one(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[int, int]:
    """Stream one completion; return (tokens generated, SSE chunks received)."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0, "stream_options": {"include_usage": True}}
    chunks, tokens = 0, 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if '"usage":{' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens, chunks - 1


async def run_level(base: str, concurrency: int, max_tokens: int,
                    frontend: dict[str, int], engine_pid: int) -> dict:
    """One level; ``frontend`` names the frontend's processes (CPU summed and reported)."""
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await stream_one(client, base + "/v1/completions", 16)  # warm-up
        fe0 = {k: cpu_seconds(p) for k, p in frontend.items()}
        en0, t0 = cpu_seconds(engine_pid), time.perf_counter()
        counts = await asyncio.gather(*(stream_one(client, base + "/v1/completions", max_tokens)
                                        for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        fe = {k: cpu_seconds(p) - fe0[k] for k, p in frontend.items()}
        en = cpu_seconds(engine_pid) - en0
    tokens = sum(t for t, _ in counts)
    chunks = sum(c for _, c in counts)
    out = {"concurrency": concurrency, "max_tokens": max_tokens, "tokens": tokens,
           "sse_chunks": chunks,
           "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
           "frontend_cpu_us_per_token": round(sum(fe.values()) / tokens * 1e6, 1),
           "engine_cpu_us_per_token": round(en / tokens * 1e6, 1)}
    if len(fe) > 1:
        out.update({f"{k}_cpu_us_per_token": round(v / tokens * 1e6, 1) for k, v in fe.items()})
    return out


def _wait(url: str, proc: subprocess.Popen, ok=lambda r: True) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 300
    while True:
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200 and ok(r):
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{url}: did not start")
        time.sleep(0.25)


def _child(pid: int) -> int:
    return int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])


def start(frontend: str, ns: argparse.Namespace) -> tuple[list[subprocess.Popen], str,
                                                         dict[str, int], int]:
    """Start the server(s): (processes, base URL, frontend pids by name, engine-core pid)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    serve = [str(Path(sys.executable).parent / "radixserve"), "serve", "--null-model",
             "--num-pages", str(ns.num_pages), "--log-level", "warning",
             "--null-step-ms", str(ns.null_step_ms)]
    port, metrics, smg_port, smg_metrics = free_ports(4)
    if frontend == "http":
        proc = subprocess.Popen([*serve, "--port", str(port)], env=env)
        _wait(f"http://127.0.0.1:{port}/health", proc)
        return [proc], f"http://127.0.0.1:{port}", {"frontend": proc.pid}, _child(proc.pid)
    smg_cmd = [str(Path(sys.executable).parent / "smg"), "launch", "--host", "127.0.0.1",
               "--port", str(smg_port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(smg_metrics), "--policy", "round_robin",
               "--log-level", "warn", "--shutdown-grace-period-secs", "1",
               "--health-check-interval-secs", "1"]
    if frontend == "smg-zmq":
        from gateway import zmq_worker  # this script's folder is on sys.path

        worker, smg, url = zmq_worker(serve[2:])
        return [smg, worker], url, {"smg": smg.pid}, worker.pid
    worker = subprocess.Popen([*serve, "--grpc", "--port", str(port), "--metrics-port",
                               str(metrics)], env=env)
    _wait(f"http://127.0.0.1:{metrics}/health", worker)
    smg = subprocess.Popen([*smg_cmd, "--worker-urls", f"grpc://127.0.0.1:{port}"], env=env)
    _wait(f"http://127.0.0.1:{smg_port}/readiness", smg,
          lambda r: r.json().get("healthy_workers") == 1)
    return ([smg, worker], f"http://127.0.0.1:{smg_port}",
            {"smg": smg.pid, "grpc_worker": worker.pid}, _child(worker.pid))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frontend", nargs="+", default=["http"], choices=["http", "smg", "smg-zmq"],
                   help="http: radixserve's FastAPI server; smg: the smg gateway over "
                        "radixserve serve --grpc; smg-zmq: smg over radixserve serve "
                        "--zmq-worker (vLLM's EngineCore wire, no Python frontend)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--num-pages", type=int, default=16384)
    p.add_argument("--null-step-ms", type=float, default=0.0,
                   help="each engine step takes this long (0: instant; >0 paces the engine so "
                        "every token is its own SSE chunk)")
    ns = p.parse_args()
    for frontend in ns.frontend:
        procs, base, pids, engine_pid = start(frontend, ns)
        try:
            for c in ns.concurrency:
                result = asyncio.run(run_level(base, c, ns.max_tokens, pids, engine_pid))
                print(json.dumps({"frontend": frontend, **result,
                                  "null_step_ms": ns.null_step_ms,
                                  "loadavg_1m": os.getloadavg()[0]}), flush=True)
        finally:
            for proc in procs:  # the gateway first, then the worker
                proc.send_signal(signal.SIGTERM)
                proc.wait(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
