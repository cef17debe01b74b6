"""Frontend CPU time per streamed token, measured against a null-model server.

Starts ``radixserve serve --null-model`` (the engine returns a fixed token instantly, so the
frontend's own work is all that is left: ZMQ receive + decode, per-request queues, incremental
detokenization, JSON encoding, SSE writes), streams ``--concurrency`` completions of
``--max-tokens`` tokens each, and reads the frontend's and the engine core's CPU time
(user + system, from /proc) before and after.

    .venv/bin/python benchmarks/frontend_cpu_per_token.py --concurrency 1 16 64 --max-tokens 2000

Prints one JSON object per concurrency level: tokens streamed, SSE chunks (a frontend that falls
behind sends several tokens per chunk), wall seconds, tokens/s, and CPU
microseconds per streamed token for the frontend and for the engine core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream_one(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[int, int]:
    """Stream one completion; return (tokens generated, SSE chunks received)."""
    body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    chunks, tokens = 0, 0
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if '"usage":{' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    return tokens, chunks - 1


async def run_level(base: str, concurrency: int, max_tokens: int, pids: tuple[int, int]
                    ) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await stream_one(client, base + "/v1/completions", 16)  # warm-up
        fe0, en0, t0 = cpu_seconds(pids[0]), cpu_seconds(pids[1]), time.perf_counter()
        counts = await asyncio.gather(*(stream_one(client, base + "/v1/completions", max_tokens)
                                        for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        fe, en = cpu_seconds(pids[0]) - fe0, cpu_seconds(pids[1]) - en0
    tokens = sum(t for t, _ in counts)
    chunks = sum(c for _, c in counts)
    return {"concurrency": concurrency, "max_tokens": max_tokens, "tokens": tokens,
            "sse_chunks": chunks,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "frontend_cpu_us_per_token": round(fe / tokens * 1e6, 1),
            "engine_cpu_us_per_token": round(en / tokens * 1e6, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--num-pages", type=int, default=16384)
    p.add_argument("--null-step-ms", type=float, default=0.0,
                   help="each engine step takes this long (0: instant; >0 paces the engine so "
                        "every token is its own SSE chunk)")
    ns = p.parse_args()
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "radixserve"), "serve", "--null-model",
           "--port", str(port), "--num-pages", str(ns.num_pages), "--log-level", "warning",
           "--null-step-ms", str(ns.null_step_ms)]
    proc = subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("server did not start")
            time.sleep(0.25)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        pids = (proc.pid, int(children[0]))
        for c in ns.concurrency:
            result = asyncio.run(run_level(base, c, ns.max_tokens, pids))
            print(json.dumps({**result, "null_step_ms": ns.null_step_ms}), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
