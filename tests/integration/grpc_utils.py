"""Start and stop real ``radixserve serve --grpc`` and ``--zmq-worker`` workers,
``radixserve fleet`` and ``smg launch`` processes on free 127.0.0.1 ports (test helpers)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
from server_utils import free_port, free_ports, pid_alive, pinned
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc


def consecutive_free_ports(n: int) -> int:
    """The first of ``n`` consecutive TCP ports free on 127.0.0.1 right now."""
    for _ in range(200):
        base = free_port()
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def _env(workdir: Path) -> dict[str, str]:
    tmp = workdir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "TMPDIR": str(tmp)}


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (children, their children, ...), from /proc."""
    out: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        for f in Path(f"/proc/{p}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                kids = [int(c) for c in f.read_text().split()]
                out += kids
                stack += kids
    return out


class Proc:
    """A child process with its output in ``workdir/NAME.log`` (``env``: extra variables)."""

    def __init__(self, name: str, cmd: list[str], workdir: Path,
                 env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**_env(self.workdir), **(env or {})})

    def log_tail(self, n: int = 6000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        return ""

    def wait_http(self, url: str, ok: callable = None, timeout_s: float = 300.0) -> None:
        """Poll ``url`` until it answers 200 (and ``ok(response)``); raise with the log if
        the process exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log_path.name}: exited with {self.proc.returncode}"
                                   f":\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(url, timeout=2)
                if r.status_code == 200 and (ok is None or ok(r)):
                    return
            time.sleep(0.25)
        raise RuntimeError(f"{self.log_path.name}: not ready after {timeout_s} s:\n"
                           f"{self.log_tail()}")

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; its descendants are killed too if any
        survived. Returns the exit status."""
        kids = descendants(self.proc.pid) if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for k in kids:
            if pid_alive(k):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(k, signal.SIGKILL)
        self._log.close()
        return self.proc.returncode


def _radixserve() -> list[str]:
    return [sys.executable, "-m", "radixserve.cli"]


class GrpcWorker(Proc):
    """A ``radixserve serve --grpc`` worker with a side ``/metrics`` port."""

    def __init__(self, args: list[str], workdir: Path, name: str = "worker",
                 env: dict[str, str] | None = None) -> None:
        self.port, self.metrics_port = free_ports(2)
        super().__init__(name, [*_radixserve(), "serve", "--grpc", "--host", "127.0.0.1",
                                "--port", str(self.port), "--metrics-port",
                                str(self.metrics_port), *pinned(args)], workdir, env)

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        self.wait_http(self.metrics_url + "/health", timeout_s=timeout_s)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def stub(self) -> pb_grpc.VllmEngineStub:
        return pb_grpc.VllmEngineStub(self.channel())


class ZmqWorker(Proc):
    """A headless ``radixserve serve --zmq-worker ipc://DIR/engine`` engine core, which smg
    drives over vLLM's EngineCore wire (``Smg(..., zmq_model=...)``). The socket directory is
    short-named under /tmp: smg binds ``ipc://DIR/engine-in.sock`` and a Unix socket path has
    at most ~100 characters."""

    def __init__(self, args: list[str], workdir: Path, name: str = "zmq-worker",
                 env: dict[str, str] | None = None) -> None:
        self.socket_dir = Path(tempfile.mkdtemp(prefix="rs-zmq-", dir="/tmp"))
        self.url = f"ipc://{self.socket_dir}/engine"
        super().__init__(name, [*_radixserve(), "serve", "--zmq-worker", self.url,
                                *pinned(args)],
                         workdir, env)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        rc = super().stop(timeout_s)
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        return rc


class Smg(Proc):
    """``smg launch`` over ``worker_urls``, or with ``pd=(prefill_url, decode_url)`` in
    prefill/decode disaggregation (``--pd-disaggregation --prefill P --decode D``; no
    bootstrap port: vLLM's NIXL-style handoff travels in ``kv_transfer_params_json``)."""

    def __init__(self, worker_urls: list[str], policy: str, workdir: Path,
                 extra: list[str] = (), name: str = "smg",
                 pd: tuple[str, str] | None = None,
                 zmq_model: tuple[str, str] | None = None) -> None:
        self.port, self.prometheus_port = free_ports(2)
        smg = str(Path(sys.executable).parent / "smg")
        workers = (["--worker-urls", *worker_urls] if pd is None else
                   ["--pd-disaggregation", "--prefill", pd[0], "--decode", pd[1]])
        if zmq_model is not None:
            # ZMQ workers (vLLM's EngineCore wire) report no model: smg loads the tokenizer
            # from the model folder and serves it under the folder's path, aliased to NAME
            model_name, folder = zmq_model
            workers += ["--backend", "vllm", "--model-path", folder,
                        "--model-alias", f"{model_name}={folder}"]
        super().__init__(name, [
            smg, "launch", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
            *workers, "--policy", policy,
            "--health-check-interval-secs", "1", "--shutdown-grace-period-secs", "1",
            "--log-level", "warn", *extra], workdir)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, n_workers: int, timeout_s: float = 120.0) -> None:
        self.wait_http(self.base_url + "/readiness",
                       lambda r: r.json().get("healthy_workers") == n_workers, timeout_s)
