"""Start and stop a real ``radixserve serve`` process on a free 127.0.0.1 port (test helper)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from radixserve.bench.ports import free_port, free_ports  # noqa: F401 - for the tests

#: How long a wait for an event may take before the test fails as hung. Generous on purpose:
#: it only turns a hang into a failure; how fast things happen is measured by the benchmarks.
HANG_TIMEOUT_S = 120.0


def pinned(args: list[str]) -> list[str]:
    """``args`` with ``--quantization none`` unless they choose a form or the null model: a
    GGUF's form is otherwise measured per machine, and these tests compare servers with the
    dense offline reference (``default_llm``) and with transformers; the block form has its
    own tests (test_quantized_default.py, test_quantized_model.py)."""
    if "--quantization" in args or "--null-model" in args:
        return list(args)
    return [*args, "--quantization", "none"]


def _serve_cmd() -> list[str]:
    script = Path(sys.executable).parent / "radixserve"
    if script.exists():
        return [str(script), "serve"]
    return [sys.executable, "-m", "radixserve.cli", "serve"]


class ServerProcess:
    """A ``radixserve serve`` child process.

    Args:
        args: extra command-line arguments (engine flags, --api-key, ...).
        workdir: holds the server log and, through TMPDIR, the IPC socket directory.
        env: extra environment variables.
    """

    def __init__(self, args: list[str], workdir: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.workdir = Path(workdir)
        self.tmpdir = self.workdir / "tmp"
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "server.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "TMPDIR": str(self.tmpdir), **(env or {})}
        self.proc = subprocess.Popen(
            [*_serve_cmd(), "--host", "127.0.0.1", "--port", str(self.port), *pinned(args)],
            stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        self.engine_pid: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        return ""

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Poll /health until 200; raise with the server log if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    self.engine_pid = self.child_pids()[0]
                    return
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.log_tail()}")

    def child_pids(self) -> list[int]:
        """Direct children of the server process (the engine core)."""
        pids: list[int] = []
        for f in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                pids += [int(p) for p in f.read_text().split()]
        return pids

    def health_failed(self) -> bool:
        """/health says 503, or nothing listens any more (the server already exited)."""
        try:
            return httpx.get(self.base_url + "/health", timeout=5).status_code == 503
        except httpx.HTTPError:
            return True

    def ipc_dirs(self) -> list[Path]:
        return sorted(self.tmpdir.glob("radixserve-*"))

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s; the engine core is killed too if it survived."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.engine_pid is not None and pid_alive(self.engine_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.engine_pid, signal.SIGKILL)
        self._log.close()


def wait_until(condition: Callable[[], object], what: str,
               timeout_s: float = HANG_TIMEOUT_S, interval_s: float = 0.05) -> object:
    """Poll ``condition`` until it returns something truthy and return that; fail naming
    ``what`` after ``timeout_s`` (a guard against hangs, never a speed requirement)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def hold_load_env(hold_dir: Path) -> dict[str, str]:
    """Environment for a ``ServerProcess`` whose engine core holds its model load until
    ``hold_dir / "release"`` exists (the hook in ``hold_load/sitecustomize.py``)."""
    hook = Path(__file__).resolve().parent / "hold_load"
    path = [str(hook), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path), "RADIXSERVE_TEST_HOLD_LOAD": str(hold_dir)}


def pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def metrics_values(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """``/metrics`` as ``{name: value}`` for unlabelled-by-reason samples (labels dropped)."""
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if "finished_reason" in name_labels or 'le="' in name_labels:
            continue
        out[name] = float(value)
    return out


def wait_idle(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and every used KV page is a radix-cache
    page (no page leaked by a live or aborted request); return the last values."""
    deadline = time.monotonic() + timeout_s
    m: dict[str, float] = {}
    while time.monotonic() < deadline:
        m = metrics_values(base_url)
        if (m.get("radixserve:num_requests_running") == 0
                and m.get("radixserve:num_requests_waiting") == 0
                and m.get("radixserve:kv_cache_pages_used")
                == m.get("radixserve:kv_cache_pages_cached")):
            return m
        time.sleep(0.1)
    raise AssertionError(f"server not idle after {timeout_s} s: {m}")
