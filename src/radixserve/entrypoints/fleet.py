"""``radixserve fleet --workers N [-- SERVE ARGS]``: N engine workers behind one smg gateway
on this machine, each worker pinned to its own CPU cores, all stopped together.

::

    radixserve fleet --workers 2 --port 8000 --policy cache_aware -- --dtype float32
    radixserve fleet --wire zmq --workers 2 --port 8000 -- --dtype float32

* ``--wire zmq``: worker i is a headless ``radixserve serve --zmq-worker ipc://DIR/worker-i``
  engine core that smg drives over vLLM's EngineCore wire (``smg launch --backend vllm
  --model-path FOLDER``, the model's Hugging Face folder, served as the model's name): no
  Python frontend per worker, and no worker ports; smg starts with the workers and the fleet is
  ready when smg counts them healthy. The rest of this list is the default, ``--wire grpc``.

* worker i is ``radixserve serve --grpc`` on ``--worker-base-port + 2i`` (its Prometheus
  ``/metrics`` and ``/health`` on the next port), with everything after ``--`` passed to it
  (model, engine flags). Its CPU affinity (``os.sched_setaffinity``, inherited by its
  engine-core process) is its own slice of this process's cores and its thread counts
  (``--num-threads``, ``OMP_NUM_THREADS``) match the slice, so two workers never fight over
  a core. With more workers than cores, slices wrap around (a warning says so).
* once every worker answers ``/health``, ``smg launch`` starts with the workers' ``grpc://``
  URLs (``--smg-arg`` adds its own flags), serving the OpenAI API on ``--host``/``--port``;
  the fleet is ready when smg's ``/readiness`` counts every worker healthy.
* a worker that exits on its own is restarted (at most ``--max-restarts`` times each); smg
  notices it through its health checks and routes to it again once it is back.
* SIGTERM or SIGINT (Ctrl-C) drains: smg stops taking connections and lets the requests in
  flight finish for up to ``--shutdown-timeout`` seconds (its
  ``--shutdown-grace-period-secs``), then every worker stops (SIGTERM, then SIGKILL after
  ``--stop-timeout`` seconds); each child also gets SIGTERM from the kernel if this process
  dies (``PR_SET_PDEATHSIG``), so nothing outlives it. Exit status: 0 after a signal, 1 when a
  worker could not start, smg died or a worker kept dying, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("radixserve.fleet")

#: Flags the fleet sets on every worker itself.
_OWNED_FLAGS = ("--grpc", "--zmq-worker", "--host", "--port", "--metrics-port")
#: Seconds between two looks at the children.
POLL_S = 0.2
_PR_SET_PDEATHSIG = 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``fleet`` subcommand to the ``radixserve`` parser."""
    p = sub.add_parser("fleet", help="N gRPC workers behind the smg gateway, one command",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="engine workers (default 2)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address of the gateway and the workers (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the gateway's HTTP port")
    p.add_argument("--prometheus-port", type=int, default=29000,
                   help="the gateway's Prometheus port (default 29000)")
    p.add_argument("--worker-base-port", type=int, default=31000,
                   help="worker i serves gRPC on BASE+2i and /metrics on BASE+2i+1")
    p.add_argument("--wire", choices=["grpc", "zmq"], default="grpc",
                   help="grpc: `radixserve serve --grpc` workers (default); zmq: headless "
                        "`radixserve serve --zmq-worker` engine cores on vLLM's EngineCore "
                        "wire (cheapest per token; no per-worker /metrics)")
    p.add_argument("--policy", default="cache_aware",
                   help="smg routing policy: cache_aware, round_robin, power_of_two, ... "
                        "(default cache_aware)")
    p.add_argument("--cores-per-worker", type=int, default=None,
                   help="CPU cores each worker gets (default: this process's cores split "
                        "evenly)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="times a worker that exits on its own is restarted (default 3)")
    p.add_argument("--stop-timeout", type=float, default=10.0,
                   help="seconds a child may take to exit on SIGTERM before SIGKILL")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="after SIGTERM, seconds the requests in flight may take to finish "
                        "(smg's grace period) before the workers stop (default 30)")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds the workers may take to load the model")
    p.add_argument("--smg-arg", action="append", default=[], metavar="ARG",
                   help="extra `smg launch` arguments, shell-split (repeatable), e.g. "
                        "--smg-arg='--cb-failure-threshold 2'")
    p.add_argument("--log-dir", default=None,
                   help="write each child's output to DIR/{smg,worker-N}.log (default: this "
                        "terminal)")
    p.add_argument("worker_args", nargs=argparse.REMAINDER,
                   help="after --: arguments for every `radixserve serve` worker")
    p.set_defaults(func=cmd_fleet)


@dataclass
class Child:
    """One supervised child process.

    Attributes:
        name: "smg" or "worker-N".
        cmd: its command line.
        env: its environment.
        cores: CPU cores it may run on (None: any).
        proc: the running process (None before start).
        restarts: times it was restarted.
    """

    name: str
    cmd: list[str]
    env: dict[str, str]
    cores: list[int] | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    log_file: Path | None = None
    _out: object = field(default=None, repr=False)

    def start(self) -> None:
        cores = self.cores

        def pre_exec() -> None:
            # the kernel sends SIGTERM to the child if the fleet dies, even by SIGKILL
            with contextlib.suppress(Exception):
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(
                    _PR_SET_PDEATHSIG, signal.SIGTERM)
            if cores:
                os.sched_setaffinity(0, cores)

        if self.log_file is not None:
            self._out = open(self.log_file, "ab")  # noqa: SIM115 - kept open while it runs
        # a session of its own: Ctrl-C reaches only the fleet, which stops children in order
        self.proc = subprocess.Popen(self.cmd, env=self.env, preexec_fn=pre_exec,
                                     start_new_session=True, stdout=self._out,
                                     stderr=subprocess.STDOUT if self._out else None)
        log.info("%s: pid %d%s: %s", self.name, self.proc.pid,
                 f" on cores {cores}" if cores else "", shlex.join(self.cmd))

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.terminate()

    def wait(self, deadline: float) -> None:
        """Wait until ``deadline`` (``time.monotonic()``), then SIGKILL; reap it."""
        if self.proc is None:
            return
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not exit in time: SIGKILL", self.name)
            self.proc.kill()
            self.proc.wait()
        if self._out is not None:
            self._out.close()  # type: ignore[attr-defined]
            self._out = None


def core_slices(cores: list[int], n: int, per_worker: int | None) -> list[list[int]]:
    """Split ``cores`` into ``n`` slices of ``per_worker`` cores (default: an even split,
    at least one each); with too few cores the slices wrap around and share.

    Raises:
        ValueError: ``n`` or ``per_worker`` below 1.
    """
    if n < 1:
        raise ValueError(f"workers={n} must be >= 1")
    k = per_worker if per_worker is not None else max(1, len(cores) // n)
    if k < 1:
        raise ValueError(f"cores_per_worker={k} must be >= 1")
    return [[cores[(i * k + j) % len(cores)] for j in range(k)] for i in range(n)]


def find_smg() -> str | None:
    """The ``smg`` launcher next to this Python (the venv's), else on PATH."""
    here = Path(sys.executable).parent / "smg"
    return str(here) if here.exists() else shutil.which("smg")


def _get_json(url: str) -> dict | None:
    with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(
            url, timeout=1.0) as r:
        body = json.loads(r.read())
        return body if isinstance(body, dict) else None
    return None


def _healthy(url: str) -> bool:
    with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(
            url, timeout=1.0) as r:
        return r.status == 200
    return False


def check_worker_args(args: list[str]) -> tuple[list[str], argparse.Namespace]:
    """The worker arguments without a leading ``--``, and ``radixserve serve``'s reading of
    them (its own parser: argparse exits 2 on a bad flag).

    Raises:
        ValueError: a flag the fleet sets itself.
    """
    if args and args[0] == "--":
        args = args[1:]
    for a in args:
        if a.split("=", 1)[0] in _OWNED_FLAGS:
            raise ValueError(f"{a.split('=', 1)[0]} is set by the fleet for each worker")
    from radixserve.entrypoints.serve_cli import register as register_serve

    p = argparse.ArgumentParser(prog="radixserve fleet -- ")
    register_serve(p.add_subparsers())
    return args, p.parse_args(["serve", *args])


def cmd_fleet(ns: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        worker_args, serve_ns = check_worker_args(ns.worker_args)
        cores = sorted(os.sched_getaffinity(0))
        slices = core_slices(cores, ns.workers, ns.cores_per_worker)
    except ValueError as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2
    smg = find_smg()
    if smg is None:
        print("radixserve: error: the smg gateway is not installed "
              "(pip install 'radixserve[gateway]')", file=sys.stderr)
        return 2
    if len({c for s in slices for c in s}) < sum(len(s) for s in slices):
        log.warning("%d workers x %d cores is more than the %d cores available: "
                    "workers share cores", ns.workers, len(slices[0]), len(cores))
    log_dir = Path(ns.log_dir) if ns.log_dir else None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    user_threads = any(a.split("=", 1)[0] == "--num-threads" for a in worker_args)
    socket_dir = None
    smg_model: list[str] = []
    if ns.wire == "zmq":
        from radixserve.model_executor.loader import resolve_model

        try:
            files = resolve_model(serve_ns.model)  # converts a GGUF once, cached
        except (ValueError, FileNotFoundError) as e:
            print(f"radixserve: error: {e}", file=sys.stderr)
            return 2
        folder = str(files.folder)
        name = serve_ns.served_model_name or files.name
        smg_model = ["--backend", "vllm", "--model-path", folder]
        if name != folder:
            smg_model += ["--model-alias", f"{name}={folder}"]
        socket_dir = Path(tempfile.mkdtemp(prefix="rs-fleet-"))
    workers: list[Child] = []
    health_urls: list[str] = []
    urls: list[str] = []
    for i, cs in enumerate(slices):
        env = dict(os.environ, OMP_NUM_THREADS=str(len(cs)), MKL_NUM_THREADS=str(len(cs)))
        cmd = [sys.executable, "-m", "radixserve.cli", "serve"]
        if socket_dir is not None:
            urls.append(f"ipc://{socket_dir}/worker-{i}")
            cmd += ["--zmq-worker", urls[-1], *worker_args]
        else:
            port = ns.worker_base_port + 2 * i
            urls.append(f"grpc://{ns.host}:{port}")
            health_urls.append(f"http://{ns.host}:{port + 1}/health")
            cmd += ["--grpc", "--host", ns.host, "--port", str(port), "--metrics-port",
                    str(port + 1), *worker_args]
        if not user_threads:
            cmd += ["--num-threads", str(len(cs))]
        workers.append(Child(f"worker-{i}", cmd, env, cs,
                             log_file=log_dir / f"worker-{i}.log" if log_dir else None))
    smg_cmd = [smg, "launch", "--host", ns.host, "--port", str(ns.port),
               "--prometheus-host", ns.host, "--prometheus-port", str(ns.prometheus_port),
               "--worker-urls", *urls, *smg_model, "--policy", ns.policy,
               "--health-check-interval-secs", "1",
               "--shutdown-grace-period-secs", str(max(1, math.ceil(ns.shutdown_timeout)))]
    for extra in ns.smg_arg:
        smg_cmd += shlex.split(extra)
    gateway = Child("smg", smg_cmd, dict(os.environ),
                    log_file=log_dir / "smg.log" if log_dir else None)
    try:
        return Fleet(workers, health_urls, gateway, ns).run()
    finally:
        if socket_dir is not None:
            shutil.rmtree(socket_dir, ignore_errors=True)


class Fleet:
    """Starts the workers, then smg; supervises them; stops them all on a signal.

    ``health_urls``: each worker's ``/health`` (gRPC workers), waited for before smg starts;
    empty for ZMQ workers, which smg's own handshake admits (``/readiness`` then says when).
    """

    def __init__(self, workers: list[Child], health_urls: list[str], gateway: Child,
                 ns: argparse.Namespace) -> None:
        self.workers = workers
        self.health_urls = health_urls
        self.gateway = gateway
        self.ns = ns
        self.stop_reason: str | None = None

    def _on_signal(self, sig: int, _frame: object) -> None:
        self.stop_reason = f"received {signal.Signals(sig).name}"

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        rc = 1
        try:
            for w in self.workers:
                w.start()
            if not self._wait_ready():
                return 0 if self.stop_reason else 1
            self.gateway.start()
            if not self._wait_gateway():
                return 0 if self.stop_reason else 1
            log.info("fleet ready: %d workers behind smg on http://%s:%d (policy %s)",
                     len(self.workers), self.ns.host, self.ns.port, self.ns.policy)
            rc = self._supervise()
            return rc
        finally:
            self._stop_all()

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.ns.start_timeout
        pending = set(range(len(self.health_urls)))
        while pending:
            if self.stop_reason is not None:
                return False
            for i in list(pending):
                w = self.workers[i]
                if not w.alive:
                    log.error("%s exited with code %s while starting", w.name,
                              w.proc.returncode if w.proc else None)
                    return False
                if _healthy(self.health_urls[i]):
                    log.info("%s ready", w.name)
                    pending.discard(i)
            if time.monotonic() > deadline:
                log.error("workers %s not ready after %.0f s",
                          [self.workers[i].name for i in pending], self.ns.start_timeout)
                return False
            time.sleep(POLL_S)
        return True

    def _wait_gateway(self) -> bool:
        """Wait until smg's ``/readiness`` counts every worker healthy."""
        url = f"http://{self.ns.host}:{self.ns.port}/readiness"
        deadline = time.monotonic() + self.ns.start_timeout
        while self.stop_reason is None:
            if not self.gateway.alive:
                log.error("smg exited with code %s while starting",
                          self.gateway.proc.returncode if self.gateway.proc else None)
                return False
            for w in self.workers:
                if not w.alive:
                    log.error("%s exited with code %s while starting", w.name,
                              w.proc.returncode if w.proc else None)
                    return False
            body = _get_json(url)
            if body and body.get("healthy_workers") == len(self.workers):
                return True
            if time.monotonic() > deadline:
                log.error("smg not ready after %.0f s: %s", self.ns.start_timeout, body)
                return False
            time.sleep(POLL_S)
        return False

    def _supervise(self) -> int:
        while self.stop_reason is None:
            if not self.gateway.alive:
                log.error("smg exited with code %s", self.gateway.proc.returncode
                          if self.gateway.proc else None)
                return 1
            for w in self.workers:
                if w.alive:
                    continue
                rc = w.proc.returncode if w.proc else None
                if w.restarts >= self.ns.max_restarts:
                    log.error("%s exited with code %s and was restarted %d times: giving up",
                              w.name, rc, w.restarts)
                    return 1
                w.restarts += 1
                log.warning("%s exited with code %s: restarting it (%d/%d)", w.name, rc,
                            w.restarts, self.ns.max_restarts)
                w.wait(time.monotonic())
                w.start()
            time.sleep(POLL_S)
        log.info("%s: stopping the fleet", self.stop_reason)
        return 0

    def _stop_all(self) -> None:
        # the gateway first, so no new request reaches a worker that is going away; it lets
        # the requests in flight finish (its grace period, --shutdown-timeout) before exiting
        self.gateway.terminate()
        self.gateway.wait(time.monotonic() + self.ns.shutdown_timeout + self.ns.stop_timeout)
        for w in self.workers:
            w.terminate()
        deadline = time.monotonic() + self.ns.stop_timeout
        for w in self.workers:
            w.wait(deadline)
