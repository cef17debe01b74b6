"""``radixserve bench overhead``: the engine core's CPU cost per step with a null model.

The engine core runs exactly as in a real server, but its runner is a ``NullRunner`` that returns
one token per sampling request instantly, so what is left is the core's own work, the seeds' KPI
("scheduler CPU time per decode step"), split into

* ``schedule``: picking the step's requests and pages (``Scheduler.schedule`` minus the metadata);
* ``prepare``: building the step's metadata with numpy (``core.batch.build_batch``);
* ``output``: applying sampled tokens, stop checks, freeing finished requests and building the
  step's outputs (column-wise for plain decodes, ``RequestOutput`` structs for the rest);
* ``transport``: msgspec-encoding the step's ``EngineOutputs``, sending it over a real ZMQ IPC
  PUSH socket, receiving it on a PULL socket and decoding it, as the frontend would;
* ``total``: wall time of the whole step (the above plus the null forward and the loop's
  bookkeeping), measured around it.

Two cases per batch size B:

* ``decode``: B requests in steady-state decode (one token each per step);
* ``mixed``: the same B decodes plus, every step, one new request whose whole prompt
  (``--prefill-len`` tokens) is prefilled in that step and finishes after its first token, so the
  running set stays at B while every step mixes a prefill chunk into the decodes.
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import zmq

from radixserve.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.engine_types import EngineRequest
from radixserve.model_executor.null_runner import NullRunner
from radixserve.sampling_params import SamplingParams
from radixserve.transport.messages import CoreMessage, decoder
from radixserve.transport.zmq_io import CoreSockets, cleanup_ipc, make_ipc_paths

PHASES = ("schedule", "prepare", "output", "transport", "total")


@dataclass
class OverheadConfig:
    """Sizes of one overhead run.

    Attributes:
        prompt_len: prompt tokens of each decoding request.
        prefill_len: prompt tokens of the request prefilled each step in ``mixed`` mode.
        steps: measured steps per case.
        warmup: steps run (after every request reached decode) before measuring.
        page_size: KV page size in tokens.
        vocab_size: token ids of the random prompts are below it.
        seed: prompt generator seed.
        overlap: the engine's overlap scheduling (the default; the null forward then runs in
            the engine's worker thread, and the hand-off is part of the measured step).
    """

    prompt_len: int = 128
    prefill_len: int = 512
    steps: int = 200
    warmup: int = 20
    page_size: int = 16
    vocab_size: int = 49152
    seed: int = 0
    overlap: bool = True


class _Transport:
    """The engine core's real output socket (``CoreSockets``, IPC) and a synchronous PULL
    socket on the other end decoding ``CoreMessage`` and converting it back to
    ``StepOutputs`` like the frontend does."""

    def __init__(self) -> None:
        self.addrs = make_ipc_paths()
        self.core = CoreSockets(*self.addrs)
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.pull.connect(self.addrs[1])
        self.dec = decoder(CoreMessage)

    def roundtrip(self, msg: Any) -> Any:
        self.core.send(msg)
        return self.dec.decode(self.pull.recv(copy=False).buffer)

    def close(self) -> None:
        self.pull.close(linger=0)
        self.ctx.term()
        self.core.close()
        cleanup_ipc(*self.addrs)


def _request(rid: str, ids: np.ndarray, max_tokens: int) -> EngineRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(request_id=rid, prompt_token_ids=ids, sampling_params=sp,
                         arrival_time=time.time(), eos_token_ids=[])


def run_case(batch_size: int, mode: str, cfg: OverheadConfig,
             transport: _Transport) -> dict[str, Any]:
    """Measure one (batch size, mode) case; returns its result row (microseconds)."""
    if mode not in ("decode", "mixed"):
        raise ValueError(f"mode={mode!r} must be 'decode' or 'mixed'")
    rng = np.random.default_rng(cfg.seed)
    ps = cfg.page_size
    mixed = mode == "mixed"
    budget = max(2048, batch_size + (cfg.prefill_len if mixed else 0))
    # the first requests admitted start decoding while later ones are still being prefilled
    # (decodes take their tokens of the budget first, so prefilling all of them takes at most
    # B * prompt_len / (budget - B) steps)
    prefill_steps = -(-batch_size * cfg.prompt_len // max(budget - batch_size, 1))
    gen_len = cfg.warmup + cfg.steps + 8 + prefill_steps
    max_model_len = max(cfg.prompt_len + gen_len, cfg.prefill_len + 2) + ps
    per_req_pages = -(-(cfg.prompt_len + gen_len) // ps)
    # room for every decode plus a few prefill requests' worth that the radix cache keeps
    # (older ones are evicted, as in a server whose cache is full)
    num_pages = batch_size * per_req_pages + 8 * -(-cfg.prefill_len // ps) + 2
    ecfg = EngineConfig(
        # mixed: with overlap the last prefill request is still in flight (running) when the
        # next one is admitted, so two rows beyond the decodes
        page_size=ps, num_pages=num_pages, max_num_seqs=batch_size + (2 if mixed else 0),
        max_num_batched_tokens=budget,
        max_model_len=max_model_len, step_timers=True, disable_overlap=not cfg.overlap)
    runner = NullRunner(num_pages, max_model_len, cfg.vocab_size)
    core = EngineCore(ecfg, runner)
    gc.collect()
    gc.freeze()  # as the engine-core process does after start-up
    for i in range(batch_size):
        ids = rng.integers(3, cfg.vocab_size, cfg.prompt_len, dtype=np.int32)
        core.add_request(_request(f"d{i}", ids, gen_len))
    # prefill everything, then reach steady-state decode
    while core.scheduler.waiting or any(
            r.num_tokens - r.num_computed != 1 for r in core.scheduler.running):
        step_out = core.step()
        if step_out is not None:
            transport.roundtrip(step_out)
    n_extra = 0

    scheduled: list[tuple[int, int]] = []

    def step() -> tuple[float, float]:
        nonlocal n_extra
        if mixed:
            ids = rng.integers(3, cfg.vocab_size, cfg.prefill_len, dtype=np.int32)
            core.add_request(_request(f"p{n_extra}", ids, 1))
            n_extra += 1
        t0 = time.perf_counter()
        out = core.step()
        t1 = time.perf_counter()
        if out is not None:
            transport.roundtrip(out)
        t2 = time.perf_counter()
        scheduled.append((core.last_num_decodes, core.last_num_prefill_tokens))
        return t2 - t0, t2 - t1

    for _ in range(cfg.warmup):
        step()
    core.timers.drain()  # type: ignore[union-attr]
    scheduled.clear()
    totals, transports = [], []
    cpu0 = time.thread_time()
    for _ in range(cfg.steps):
        tot, tr = step()
        totals.append(tot)
        transports.append(tr)
    cpu = time.thread_time() - cpu0
    timers = core.timers.drain()  # type: ignore[union-attr]
    if hasattr(core, "shutdown"):
        core.shutdown()  # the overlap worker thread
    decodes = statistics.fmean(d for d, _ in scheduled)
    prefill = statistics.fmean(p for _, p in scheduled)
    # every measured step must be the case it claims to be
    assert decodes == batch_size, f"{mode} B={batch_size}: {decodes} decodes per step"
    assert prefill == (cfg.prefill_len if mixed else 0), (
        f"{mode} B={batch_size}: {prefill} prefill tokens per step")

    def us(xs: list[float]) -> float:
        return 1e6 * statistics.fmean(xs)

    per_step = {"schedule": us(timers["schedule"]), "prepare": us(timers["prepare"]),
                "output": us(timers["output"]), "transport": us(transports),
                "total": us(totals)}
    median = {"schedule": timers["schedule"], "prepare": timers["prepare"],
              "output": timers["output"], "transport": transports, "total": totals}
    return {
        "batch_size": batch_size, "mode": mode, "us_per_step": per_step,
        # per-phase medians: less sensitive to other processes taking the CPU mid-step
        "median_us_per_step": {k: 1e6 * statistics.median(v) for k, v in median.items()},
        "us_per_request": per_step["total"] / batch_size,
        "median_total_us": 1e6 * statistics.median(totals),
        "p90_total_us": 1e6 * float(np.percentile(totals, 90)),
        "null_forward_us": us(timers["forward"]),
        # CPU time of this thread (excludes ZMQ's I/O thread) over the measured steps
        "thread_cpu_us_per_step": 1e6 * cpu / cfg.steps,
        "steps": cfg.steps,
        "tokens_per_step": decodes + prefill,
        "overlap": cfg.overlap,
    }


def run(batch_sizes: list[int], modes: list[str], cfg: OverheadConfig,
        repeat: int = 1) -> dict[str, Any]:
    """Every (batch size, mode) case over one shared transport; the JSON document.

    With ``repeat`` > 1 each case runs that many times and the run with the lowest mean total
    is kept (the least disturbed by other processes on a shared machine); every run's total is
    listed under ``all_totals_us``."""
    transport = _Transport()
    results = []
    load0 = machine_info().get("loadavg_1m")
    try:
        for mode in modes:
            for b in batch_sizes:
                runs = []
                for _ in range(max(1, repeat)):
                    runs.append(run_case(b, mode, cfg, transport))
                    gc.collect()  # the finished case's engine, outside the measured steps
                best = min(runs, key=lambda r: r["us_per_step"]["total"])
                best["all_totals_us"] = [r["us_per_step"]["total"] for r in runs]
                results.append(best)
    finally:
        transport.close()
    machine = machine_info()
    machine["loadavg_1m_before"] = load0
    return {"config": {**cfg.__dict__, "batch_sizes": batch_sizes, "modes": modes,
                       "repeat": repeat},
            "machine": machine, "results": results}


#: the /proc/cpuinfo flags that decide which kernels and dtype a CPU gets, recorded with every
#: figure (``machine_info``)
KIND_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_kind(flags: set[str] | frozenset[str]) -> str:
    """The CPU kind a figure was taken on, from its /proc/cpuinfo ``flags``: "amx" (AMX-BF16),
    "avx512-bf16" (AVX-512 with BF16 dot products, no AMX), "avx512" (AVX-512 without bf16
    arithmetic, e.g. Ice Lake-SP: ``--dtype auto`` = float32), "avx2" (AVX2 + FMA, no AVX-512)
    or "other". The kinds of docs/benchmarks.md."""
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    if "avx512f" in flags:
        return "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    return "other"


def machine_info() -> dict[str, Any]:
    """CPU model, kind and deciding flags (``cpu_kind``, ``KIND_FLAGS``), core count, load and
    versions, for the record."""
    import sys

    from radixserve import __version__ as rs_version
    from radixserve.model_executor.kernels.cpu import cpu_signature

    cpu = platform.processor() or ""
    flags: set[str] = set()
    for line in cpu_signature().splitlines():  # the first processor's model name and flags
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    info: dict[str, Any] = {"cpu": cpu, "cpu_kind": cpu_kind(flags),
                            "cpu_flags": [f for f in KIND_FLAGS if f in flags],
                            "cores": os.cpu_count(),
                            "python": sys.version.split()[0], "radixserve": rs_version,
                            "numpy": np.__version__, "msgspec": msgspec.__version__,
                            "pyzmq": zmq.__version__,
                            "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    from importlib import metadata

    for pkg in ("torch", "transformers"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            info[pkg] = metadata.version(pkg)
    with contextlib.suppress(OSError):
        info["loadavg_1m"] = os.getloadavg()[0]
    return info


def format_table(doc: dict[str, Any]) -> str:
    """Human-readable table of a ``run`` document."""
    lines = [f"{'mode':<7}{'batch':>7}" + "".join(f"{p:>11}" for p in PHASES) + f"{'us/req':>9}"]
    for r in doc["results"]:
        u = r["us_per_step"]
        lines.append(f"{r['mode']:<7}{r['batch_size']:>7}"
                     + "".join(f"{u[p]:>11.1f}" for p in PHASES)
                     + f"{r['us_per_request']:>9.2f}")
    return "\n".join(lines)
