"""Prefill/decode disaggregation benchmarks.

``radixserve bench pd-transfer``: how fast one prompt's KV moves between two processes with
each connector (the decode side's read, timed alone), next to copies inside one process:
``memcpy`` (one contiguous ``torch`` copy of the same bytes) and the page-wise gather/scatter
the TCP connector does at each end. The KV has the model's geometry (layers, KV heads, head
dim, dtype); "contiguous" pages form one run per layer on both sides, "scattered" pages are a
random permutation on the decode side (one NIXL descriptor per page and layer).

``radixserve bench pd-serve``: TTFT and ITL of short chats, with long prompts arriving among
them, through ``vllm-router``: one prefill + one decode instance (``--vllm-pd-disaggregation``)
versus two colocated instances (round robin), each instance pinned to its own core. The point
of disaggregation is that a long prefill no longer stalls the decodes of everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from radixserve.bench.datasets import BenchPrompt, random_text
from radixserve.bench.ports import free_ports
from radixserve.bench.serve import (
    _arrivals,
    _stats,
    build_payload,
    client_session,
    send_request,
)

# ---------------------------------------------------------------------------- transfer


def kv_geometry(model: str | None, dtype: str) -> dict[str, Any]:
    """Layers, KV heads, head dim and the KV dtype (``dtype`` "auto" resolved as the engine
    does) of ``model`` (None: the default model), without loading weights."""
    from radixserve.model_executor.device_policy import resolve_dtype
    from radixserve.model_executor.loader import load_hf_config, resolve_model

    files = resolve_model(model)
    hf = load_hf_config(files.folder)
    heads = int(hf.num_attention_heads)
    return {"model": files.name, "num_layers": int(hf.num_hidden_layers),
            "num_kv_heads": int(getattr(hf, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(hf, "head_dim", None) or hf.hidden_size // heads),
            "dtype": str(resolve_dtype(dtype, torch.device("cpu"))).removeprefix("torch.")}


def _tensors(geo: dict[str, Any], num_pages: int, page_size: int, seed: int | None
             ) -> list[torch.Tensor]:
    """Per-layer KV tensors ``[2, num_pages, page_size, heads, dim]``; random when ``seed``
    is given (the same seed gives the same data), zeros otherwise."""
    dtype = getattr(torch, geo["dtype"])
    shape = (2, num_pages, page_size, geo["num_kv_heads"], geo["head_dim"])
    if seed is None:
        return [torch.zeros(shape, dtype=dtype) for _ in range(geo["num_layers"])]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(geo["num_layers"])]


def _prefill_peer(connector: str, geo: dict[str, Any], num_pages: int, page_size: int,
                  leases: int, conn: Any) -> None:
    """The prefill side, in its own process: KV registered, ``leases`` leases granted on
    pages 1..num_pages-1; sends (host, port, engine id), serves until told to stop."""
    from radixserve.config import KVTransferConfig
    from radixserve.kv_transfer.factory import create_worker_connector

    cfg = KVTransferConfig(kv_connector=connector, kv_role="kv_producer", kv_lease_s=3600)
    worker = create_worker_connector(cfg, geo["model"])
    worker.register_kv_caches({str(i): t for i, t in
                               enumerate(_tensors(geo, num_pages, page_size, seed=0))})
    for i in range(leases):
        worker.leases.grant(f"r{i}", list(range(1, num_pages)))
    conn.send((worker.host, worker.port, cfg.engine_id))
    conn.recv()
    worker.shutdown()


def _gbps(nbytes: int, seconds: list[float]) -> dict[str, float]:
    a = np.asarray(seconds)
    return {"median_s": float(np.median(a)), "min_s": float(a.min()),
            "gb_per_s_median": nbytes / float(np.median(a)) / 1e9,
            "gb_per_s_best": nbytes / float(a.min()) / 1e9}


def _measure(connector: str, geo: dict[str, Any], num_pages: int, page_size: int,
             remote: np.ndarray, layouts: dict[str, np.ndarray], expect: list[torch.Tensor],
             nbytes: int, repeats: int) -> dict[str, Any]:
    """One connector: a prefill process holds the KV, this process reads it ``repeats`` times
    per page layout and checks the bytes."""
    from radixserve.config import KVTransferConfig
    from radixserve.kv_transfer.factory import create_worker_connector
    from radixserve.kv_transfer.pull import RecvSpec, RemoteSource

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_peer, daemon=True,
                       args=(connector, geo, num_pages, page_size,
                             repeats * len(layouts) + 1, child))
    proc.start()
    out: dict[str, Any] = {}
    try:
        if not parent.poll(300):
            raise RuntimeError(f"{connector}: the prefill process did not start")
        host, port, engine_id = parent.recv()
        worker = create_worker_connector(
            KVTransferConfig(kv_connector=connector, kv_role="kv_consumer"), geo["model"])
        local = _tensors(geo, num_pages, page_size, seed=None)
        worker.register_kv_caches({str(i): t for i, t in enumerate(local)})
        lease_ids = (f"r{i}" for i in range(repeats * len(layouts) + 1))

        def load(local_pages: np.ndarray) -> float:
            src = RemoteSource(engine_id, next(lease_ids), host, port, remote)
            return worker.load_blocking(RecvSpec(src.request_id, src, local_pages, remote))

        t0 = time.perf_counter()
        load(layouts["contiguous"])
        out["first_read_with_handshake_s"] = time.perf_counter() - t0
        for name, lp in layouts.items():
            times = [load(lp) for _ in range(repeats)]
            ok = all(torch.equal(a[:, lp], b[:, remote]) for a, b in
                     zip(local, expect, strict=True))
            out[name] = {**_gbps(nbytes, times), "verified": ok}
        worker.shutdown()
    except Exception as e:  # noqa: BLE001 - a connector that cannot run is reported
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        with contextlib.suppress(OSError, BrokenPipeError):
            parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


def run_transfer(tokens: int, connectors: list[str], page_size: int, model: str | None,
                 dtype: str, repeats: int) -> dict[str, Any]:
    """Read one ``tokens``-token prompt's KV pages from another process with each connector,
    ``repeats`` times per page layout; and the in-process copies of the same bytes."""
    geo = kv_geometry(model, dtype)
    pages = -(-tokens // page_size)
    num_pages = pages + 1  # and the null page 0
    layer_bytes = 2 * pages * page_size * geo["num_kv_heads"] * geo["head_dim"] * \
        torch.empty(0, dtype=getattr(torch, geo["dtype"])).element_size()
    nbytes = layer_bytes * geo["num_layers"]
    res: dict[str, Any] = {"config": {**geo, "tokens": tokens, "page_size": page_size,
                                      "pages": pages, "bytes": nbytes, "repeats": repeats},
                           "load_avg_before": list(os.getloadavg())}
    expect = _tensors(geo, num_pages, page_size, seed=0)
    remote = np.arange(1, num_pages, dtype=np.int32)
    layouts = {"contiguous": remote.copy(),
               "scattered": np.random.default_rng(0).permutation(remote).astype(np.int32)}
    for connector in connectors:
        res[connector] = _measure(connector, geo, num_pages, page_size, remote, layouts,
                                  expect, nbytes, repeats)
    # the same bytes copied inside one process
    dst = _tensors(geo, num_pages, page_size, seed=None)
    flat_src = torch.cat([t.reshape(-1) for t in expect])
    flat_dst = torch.empty_like(flat_src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        flat_dst.copy_(flat_src)
        times.append(time.perf_counter() - t0)
    res["memcpy"] = _gbps(nbytes, times)
    idx = torch.as_tensor(layouts["scattered"], dtype=torch.long)
    src_idx = torch.as_tensor(remote, dtype=torch.long)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for s, d in zip(expect, dst, strict=True):
            d.index_copy_(1, idx, s.index_select(1, src_idx))
        times.append(time.perf_counter() - t0)
    res["page_gather_scatter"] = _gbps(nbytes, times)
    res["load_avg_after"] = list(os.getloadavg())
    return res


# ---------------------------------------------------------------------------- serving


class _Proc:
    """A child process pinned to ``cores`` (``sched_setaffinity``), logging to ``log``."""

    def __init__(self, cmd: list[str], log: Path, cores: set[int] | None,
                 env: dict[str, str] | None = None) -> None:
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()

        def pin() -> None:
            if cores:
                os.sched_setaffinity(0, cores)

        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=pin, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def _wait(url: str, proc: _Proc, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def _exe(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found (pip install it into this environment)")
    return found


def _workload(tok: Any, n: int, long_every: int, short_len: int, long_len: int,
              output_len: int, long_output_len: int, seed: int) -> list[tuple[str, BenchPrompt]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        is_long = long_every > 0 and i % long_every == long_every // 2
        text = random_text(long_len if is_long else short_len, tok, rng)
        out.append(("long" if is_long else "short",
                    BenchPrompt([], long_output_len if is_long else output_len, text)))
    return out


async def _drive(base_url: str, model: str, work: list[tuple[str, BenchPrompt]],
                 rate: float, seed: int) -> dict[str, Any]:
    url = base_url + "/v1/chat/completions"
    async with client_session(900) as client:
        for _ in range(2):  # warm-up: both instances behind the router
            w = await send_request(client, url, build_payload(
                BenchPrompt([], 4, "Say hi."), "chat", model, True, 0.0), "chat", 0)
            if not w.ok:
                raise RuntimeError(f"warm-up failed: {w.error}")
        rng = np.random.default_rng(seed)
        tasks = []
        t0 = time.perf_counter()
        async for i in _arrivals(len(work), rate, 1.0, rng):
            kind, p = work[i]
            body = build_payload(p, "chat", model, True, 0.0)
            tasks.append((kind, asyncio.create_task(send_request(client, url, body, "chat", 0))))
        results = [(kind, await t) for kind, t in tasks]
        duration = time.perf_counter() - t0
    out: dict[str, Any] = {"duration_s": duration}
    for kind in ("short", "long"):
        rs = [r for k, r in results if k == kind]
        ok = [r for r in rs if r.ok]
        out[kind] = {"requests": len(rs), "failed": len(rs) - len(ok),
                     "ttft_ms": _stats([r.ttft for r in ok]),
                     "itl_ms": _stats([x for r in ok for x in r.itl]),
                     "errors": sorted({r.error for r in rs if not r.ok})[:3]}
        for q in (50, 99):
            vals = [x for r in ok for x in r.itl]
            out[kind]["itl_ms"][f"p{q}"] = float(np.percentile(vals, q) * 1e3) if vals else 0.0
            vals = [r.ttft for r in ok]
            out[kind]["ttft_ms"][f"p{q}"] = float(np.percentile(vals, q) * 1e3) if vals else 0.0
    return out


def run_serve(*, connector: str, num_requests: int, long_every: int, short_len: int,
              long_len: int, output_len: int, long_output_len: int, rate: float,
              threads: int, dtype: str, num_pages: int, workdir: Path, seed: int,
              setups: list[str]) -> dict[str, Any]:
    """Both setups one after the other on the same workload; each instance on its own core
    (cores 0 and 1, ``threads`` torch threads each)."""
    from radixserve.model_executor.loader import load_tokenizer, resolve_model

    files = resolve_model(None)
    tok = load_tokenizer(files.folder)
    work = _workload(tok, num_requests, long_every, short_len, long_len, output_len,
                     long_output_len, seed)
    ncpu = os.cpu_count() or 1
    cores = [{0}, {1 % ncpu}]
    serve = [_exe("radixserve"), "serve", "--dtype", dtype, "--num-pages", str(num_pages),
             "--num-threads", str(threads), "--max-model-len", str(long_len + 512)]
    res: dict[str, Any] = {"config": {
        "connector": connector, "num_requests": num_requests, "long_every": long_every,
        "short_input_tokens": short_len, "long_input_tokens": long_len,
        "output_tokens": output_len, "long_output_tokens": long_output_len,
        "request_rate": rate, "threads_per_instance": threads, "dtype": dtype,
        "cores": [sorted(c) for c in cores], "cpu_count": ncpu, "router": "vllm-router"}}
    workdir.mkdir(parents=True, exist_ok=True)
    for setup in setups:
        procs: list[_Proc] = []
        try:
            ports = free_ports(2)
            roles = (["kv_producer", "kv_consumer"] if setup == "pd" else [None, None])
            for i, role in enumerate(roles):
                cmd = [*serve, "--host", "127.0.0.1", "--port", str(ports[i])]
                if role:
                    cmd += ["--kv-transfer-config",
                            json.dumps({"kv_connector": connector, "kv_role": role})]
                procs.append(_Proc(cmd, workdir / f"{setup}-{i}.log", cores[i]))
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            for u, pr in zip(urls, procs, strict=True):
                _wait(u + "/health", pr)
            rport, rmetrics = free_ports(2)
            rcmd = [_exe("vllm-router"), "--host", "127.0.0.1", "--port", str(rport),
                    "--policy", "round_robin", "--worker-startup-check-interval", "1",
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(rmetrics),
                    "--log-level", "warning"]
            rcmd += (["--vllm-pd-disaggregation", "--prefill", urls[0], "--decode", urls[1]]
                     if setup == "pd" else ["--worker-urls", *urls])
            router = _Proc(rcmd, workdir / f"{setup}-router.log", None)
            procs.append(router)
            _wait(f"http://127.0.0.1:{rport}/health", router)
            load0 = list(os.getloadavg())
            out = asyncio.run(_drive(f"http://127.0.0.1:{rport}", files.name, work, rate, seed))
            res[setup] = {**out, "load_avg_before": load0, "load_avg_after":
                          list(os.getloadavg())}
        except Exception as e:  # noqa: BLE001 - reported in the results
            res[setup] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for pr in reversed(procs):
                pr.stop()
    return res


def format_serve(res: dict[str, Any]) -> str:
    """A short table: per setup and request kind, TTFT and ITL p50/p99 in ms."""
    lines = [f"{'setup':<11}{'kind':<7}{'n':>4}{'fail':>5}{'ttft_p50':>10}{'ttft_p99':>10}"
             f"{'itl_p50':>9}{'itl_p99':>9}"]
    for setup in ("pd", "colocated"):
        r = res.get(setup)
        if not r:
            continue
        if "error" in r:
            lines.append(f"{setup:<11}error: {r['error']}")
            continue
        for kind in ("short", "long"):
            k = r[kind]
            lines.append(f"{setup:<11}{kind:<7}{k['requests']:>4}{k['failed']:>5}"
                         f"{k['ttft_ms']['p50']:>10.1f}{k['ttft_ms']['p99']:>10.1f}"
                         f"{k['itl_ms']['p50']:>9.1f}{k['itl_ms']['p99']:>9.1f}")
    return "\n".join(lines)


def format_transfer(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [f"KV of {c['tokens']} tokens ({c['bytes'] / 1e6:.1f} MB, {c['dtype']}, "
             f"{c['num_layers']} layers)"]
    for name in ("NixlConnector", "TcpConnector"):
        r = res.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"{name:<22} error: {r['error']}")
            continue
        for layout in ("contiguous", "scattered"):
            x = r[layout]
            lines.append(f"{name + ' ' + layout:<34}{x['gb_per_s_median']:>7.2f} GB/s "
                         f"(best {x['gb_per_s_best']:.2f}, verified {x['verified']})")
    for name in ("memcpy", "page_gather_scatter"):
        x = res[name]
        lines.append(f"{name:<34}{x['gb_per_s_median']:>7.2f} GB/s "
                     f"(best {x['gb_per_s_best']:.2f})")
    return "\n".join(lines)

