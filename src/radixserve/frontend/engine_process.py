"""Supervision of the engine-core process: spawn it, notice when it exits, stop or kill it.

The process is a fresh interpreter (``python -m radixserve.core.engine_proc``), never a fork:
torch may already run threads in the frontend. It gets its own session, so a Ctrl-C in the
terminal reaches only the frontend, which then shuts the core down in order. Talking to it is
``AsyncEngineClient``'s job; this module only owns its life.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable

from radixserve.config import EngineConfig
from radixserve.transport.zmq_io import cleanup_ipc, make_ipc_paths

log = logging.getLogger("radixserve.frontend")


class EngineProcess:
    """One engine-core child process.

    Args:
        config: the engine configuration (passed to the child as JSON).
        null_model: run the core with ``NullRunner`` (overhead measurements).
        null_step_ms: with ``null_model``, milliseconds each engine step takes (0: instant).

    Attributes:
        addrs: ``(input, output)`` ``ipc://`` addresses the child binds, once started.
        proc: the child, once started.
        exited: set (on the event loop) once the child has exited.
    """

    def __init__(self, config: EngineConfig, null_model: bool = False,
                 null_step_ms: float = 0.0) -> None:
        self.config = config
        self.null_model = null_model
        self.null_step_ms = null_step_ms
        self.addrs: tuple[str, str] | None = None
        self.proc: subprocess.Popen | None = None
        self.exited = asyncio.Event()

    @property
    def alive(self) -> bool:
        """Started and not exited yet."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def start(self, on_exit: Callable[[int], None]) -> tuple[str, str]:
        """Spawn the child in a private IPC directory; call from the event loop.

        Args:
            on_exit: called on this event loop with the exit status when the child exits,
                whatever the reason (after ``exited`` is set).

        Returns:
            the ``(input, output)`` socket addresses to connect to.
        """
        loop = asyncio.get_running_loop()
        self.addrs = make_ipc_paths()
        cmd = [sys.executable, "-m", "radixserve.core.engine_proc",
               "--input", self.addrs[0], "--output", self.addrs[1],
               "--parent-pid", str(os.getpid()),
               "--config", json.dumps(dataclasses.asdict(self.config))]
        if self.null_model:
            cmd += ["--null-model", "--null-step-ms", str(self.null_step_ms)]
        self.proc = subprocess.Popen(cmd, start_new_session=True)
        log.info("engine core process started: pid %d", self.proc.pid)
        proc = self.proc

        def exited(rc: int) -> None:
            self.exited.set()
            on_exit(rc)

        def watch() -> None:
            rc = proc.wait()
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(exited, rc)

        threading.Thread(target=watch, name="engine-watch", daemon=True).start()
        return self.addrs

    def terminate(self) -> None:
        """SIGTERM (interrupts a model load; a running core finishes its step and exits 0)."""
        if self.alive:
            assert self.proc is not None
            self.proc.terminate()

    async def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` seconds for the child to exit, then kill it; returns once
        it is reaped. No-op when it was never started."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                await asyncio.wait_for(self.exited.wait(), timeout_s)
            except asyncio.TimeoutError:
                log.warning("engine core did not exit within %.1f s: killing it", timeout_s)
                proc.kill()
        await asyncio.to_thread(proc.wait)

    def cleanup(self) -> None:
        """Remove the IPC socket files and their directory (call after the child exited)."""
        if self.addrs is not None:
            cleanup_ipc(*self.addrs)
