"""The engine-core process: ``EngineCore`` behind the two ZMQ sockets (DESIGN §1, §3).

Started by the frontend (``AsyncEngineClient``) as a fresh interpreter::

    python -m radixserve.core.engine_proc --input ipc://.../input.sock \\
        --output ipc://.../output.sock --parent-pid PID --config '{"model": null, ...}'

so no fork ever happens after torch has started threads. The process

1. binds its sockets, loads the model (the slow part), and only then answers the frontend's
   ``Hello`` with the engine's ``EngineInfo`` (its ``pid`` set): the frontend is ready exactly
   when the model is;
2. loops: drain the input socket (blocking with a short timeout when idle, non-blocking when
   busy), add requests and aborts, answer ``FlushCache`` at once, run one ``step()``, send
   its ``StepOutputs`` with the scheduler's stats attached;
3. exits 0 on ``Shutdown``, SIGTERM or SIGINT, or when its parent is gone (checked every
   ``PARENT_CHECK_S``, and noticed by a send that finds no frontend for ``SEND_TIMEOUT_MS``),
   so no orphan survives a killed frontend; on any other exception it sends
   ``EngineError`` and exits 1.

The same loop (``EngineLoop`` over an ``EnginePort``) serves smg directly on vLLM's EngineCore
wire (``run_vllm_engine_process``, ``radixserve serve --zmq-worker URL``): there the process
is the server's main process, connects instead of binding, and answers ``ENGINE_CORE_DEAD``
on exit instead of ``EngineError``.

The engine's own structs cross the socket (``engine_types.EngineRequest`` in, ``StepOutputs``
out; ``transport.messages`` encodes them). A request the core rejects (``EngineCore.add_request`` raises
``RequestRejected``, or any ValueError) becomes one output with ``error``, ``error_param`` and
``error_code`` set and ``finish_reason="abort"``; other requests carry on.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import msgspec

from radixserve.config import EngineConfig
from radixserve.engine_types import (
    FINISH_ABORT,
    EngineRequest,
    SchedulerStats,
    StepOutputs,
    TokenOutput,
)
from radixserve.logs import configure_logging
from radixserve.transport.messages import AbortRequests, FlushCache, Shutdown
from radixserve.transport.zmq_io import CoreSockets, PeerGone, cleanup_ipc

log = logging.getLogger("radixserve.engine")

#: Seconds between checks that the parent (frontend) process still exists.
PARENT_CHECK_S = 0.5
#: Milliseconds one idle wait for input lasts (bounds the reaction time to signals).
IDLE_POLL_MS = 200
#: Milliseconds one wait for input lasts while KV transfers (leases) are pending: how late a
#: lease's end frees its pages at most.
KV_POLL_MS = 10
#: Seconds the core waits for the frontend's Hello after the model has loaded.
HANDSHAKE_TIMEOUT_S = 60.0
#: Milliseconds a send may find no frontend on the output socket before the core stops (a
#: killed frontend while requests run: the send would otherwise block forever).
SEND_TIMEOUT_MS = 2000
#: Environment variable: "1" runs ``Scheduler.check_integrity`` after every engine step.
CHECK_INTEGRITY_ENV = "RADIXSERVE_CHECK_INTEGRITY"


def build_engine(config: EngineConfig, null_model: bool = False,
                 null_step_s: float = 0.0) -> Any:
    """Load the model and build the ``EngineCore`` (seconds: this is the model load).

    Args:
        config: engine configuration.
        null_model: use ``NullRunner`` (returns a fixed token instantly, no weights) with the
            configured model's tokenizer facts; for measuring the server's own overhead.
        null_step_s: with ``null_model``, sleep this long in every step (emulates a forward
            pass of that duration; 0 = instant).

    Raises:
        ValueError: unreadable model, unsupported architecture, bad configuration.
    """
    from radixserve.core.engine_core import EngineCore
    from radixserve.model_executor.factory import build_runner

    engine = EngineCore(config, build_runner(config, null_model, null_step_s))
    # for tests of real processes: assert the KV invariants after every step (an
    # AssertionError ends the engine with EngineError, so a broken invariant cannot pass)
    engine.check_integrity_each_step = os.environ.get(CHECK_INTEGRITY_ENV) == "1"
    return engine


class EnginePort(Protocol):
    """Where an ``EngineLoop`` gets commands and sends step outputs: radixserve's own wire
    (``transport.zmq_io.CoreSockets``, to its frontend) or vLLM's EngineCore wire
    (``transport.vllm_zmq.VllmEnginePort``, to smg)."""

    def recv_commands(self, timeout_ms: int | None) -> list[Any]:
        """Queued commands (``EngineRequest``, a rejection's ``TokenOutput``,
        ``AbortRequests``, ``FlushCache``, ``Shutdown``), waiting up to ``timeout_ms``."""
        ...

    def send_step(self, step: StepOutputs, stats: SchedulerStats) -> None:
        """One step's outputs (raises ``PeerGone`` when the frontend is gone)."""
        ...

    def send_flushed(self, call_id: int, pages_freed: int) -> None:
        """Answer a ``FlushCache``."""
        ...

    def send_error(self, message: str) -> None:
        """The engine failed (never raises)."""
        ...


class EngineLoop:
    """Drives one ``EngineCore`` from an ``EnginePort`` until shutdown.

    Args:
        engine: the loaded ``EngineCore``.
        port: connected, handshake done.
        parent_pid: exit when ``os.getppid()`` stops being this (None: never check).
    """

    def __init__(self, engine: Any, port: EnginePort, parent_pid: int | None) -> None:
        self.engine = engine
        self.port = port
        self.parent_pid = parent_pid
        self.stop_reason: str | None = None
        self._rejected: list[TokenOutput] = []
        self._dirty = False
        self._next_parent_check = 0.0
        self._drain_deadline: float | None = None

    @property
    def draining(self) -> bool:
        """``begin_drain`` was called."""
        return self._drain_deadline is not None

    def request_stop(self, reason: str) -> None:
        """Make ``run`` return after the current step (safe from a signal handler)."""
        self.stop_reason = reason

    def begin_drain(self, timeout_s: float) -> None:
        """Refuse new requests (each answered at once with an error naming the drain) and keep
        stepping the ones in flight; ``run`` returns once none is left or ``timeout_s`` seconds
        passed (what still runs then ends with the engine). Safe from a signal handler.

        The next message's stats say so (``SchedulerStats.draining``), sent at once even when
        no step runs, so the peer can stop routing here before it sends more."""
        self._drain_deadline = time.monotonic() + timeout_s
        self._dirty = True

    def run(self) -> str:
        """Loop until Shutdown, a signal or the parent's death; returns the reason."""
        try:
            return self._run()
        except PeerGone as e:
            return f"the frontend is gone ({e})"

    def _run(self) -> str:
        engine = self.engine
        # KV transfers (held leases) need steps even when no request runs: then the loop waits
        # for input only briefly
        kv_work = getattr(engine, "has_kv_transfer_work", lambda: False)
        while self.stop_reason is None:
            if engine.has_unfinished_requests() or self._rejected:
                timeout = 0
            else:
                timeout = KV_POLL_MS if kv_work() else IDLE_POLL_MS
            cmds = self.port.recv_commands(timeout)
            self._check_parent()
            for cmd in cmds:
                self._handle(cmd)
            if self.stop_reason is not None:
                break
            step = engine.step() if engine.has_unfinished_requests() or kv_work() else None
            if self._rejected:
                rejected, self._rejected = self._rejected, []
                if step is None:
                    step = StepOutputs(step=engine.step_count, outputs=rejected)
                else:
                    step.outputs.extend(rejected)
            if step is None and self._dirty:
                # aborts without notification still change the stats the frontend shows
                step = StepOutputs(step=engine.step_count)
            if step is not None:
                stats = msgspec.structs.replace(engine.get_stats(),
                                                step_timings=engine.drain_step_timings(),
                                                draining=self.draining)
                self.port.send_step(step, stats)
                self._dirty = False
            deadline = self._drain_deadline
            if deadline is not None and not self._rejected:
                if not engine.has_unfinished_requests():
                    self.request_stop("drained: no request running")
                elif time.monotonic() >= deadline:
                    self.request_stop("shutdown timeout passed: the requests still running "
                                      "end with the engine")
        return self.stop_reason

    def _handle(self, cmd: Any) -> None:
        if isinstance(cmd, EngineRequest) and self.draining:
            log.info("request %s refused: the engine is draining", cmd.request_id)
            self._rejected.append(TokenOutput(
                request_id=cmd.request_id, finish_reason=FINISH_ABORT,
                error="the engine is draining: it finishes its running requests and stops; "
                      "retry on another worker", error_code="draining"))
        elif isinstance(cmd, EngineRequest):
            try:
                self.engine.add_request(cmd)
            except ValueError as e:
                # RequestRejected names the field; any other ValueError from admission is still
                # this request's fault alone, never a reason to take the engine down
                log.warning("request %s rejected (%s): %s", cmd.request_id,
                            getattr(e, "param", None), e)
                self._rejected.append(TokenOutput(
                    request_id=cmd.request_id, finish_reason=FINISH_ABORT, error=str(e),
                    error_param=getattr(e, "param", None), error_code=getattr(e, "code", None)))
        elif isinstance(cmd, TokenOutput):  # rejected by the port before it became a request
            self._rejected.append(cmd)
        elif isinstance(cmd, AbortRequests):
            self.engine.abort_requests(cmd.request_ids, notify=False)
            self._dirty = True
        elif isinstance(cmd, FlushCache):
            freed = self.engine.flush_cache()
            log.info("flush_cache: %d KV pages freed", freed)
            self.port.send_flushed(cmd.call_id, freed)
            self._dirty = True  # the stats (cached pages) changed
        elif isinstance(cmd, Shutdown):
            self.request_stop("shutdown requested")

    def _check_parent(self) -> None:
        if self.parent_pid is None:
            return
        now = time.monotonic()
        if now < self._next_parent_check:
            return
        self._next_parent_check = now + PARENT_CHECK_S
        if os.getppid() != self.parent_pid:
            self.request_stop(f"parent process {self.parent_pid} is gone")


class TokenizerClassProbe:
    """Finds the tokenizer class AutoTokenizer picks for the model's folder
    (``loader.auto_tokenizer_class``, 0.3-1 s), on a thread beside the model load where the
    folder is known before it (``loader.folder_if_ready``), so the frontend loads that class
    without importing torch.

    Args:
        model: ``EngineConfig.model`` (None: the default model).
    """

    def __init__(self, model: str | None) -> None:
        from radixserve.model_executor.loader import auto_tokenizer_class, folder_if_ready

        self._folder = folder_if_ready(model)
        self._early: Future[str] | None = None
        if self._folder is not None:
            # imported here, before the thread starts: two threads importing the same package
            # can meet in a cycle of module locks (CPython's _DeadlockError), which would fail
            # the model load; the model load imports transformers and torch anyway
            from transformers import AutoTokenizer  # noqa: F401

            pool = ThreadPoolExecutor(1, thread_name_prefix="radixserve-tokenizer")
            self._early = pool.submit(auto_tokenizer_class, self._folder)
            pool.shutdown(wait=False)

    def result(self, folder: str) -> str:
        """The class for the engine's ``folder`` ("" for none): the early answer where the
        folders agree, else resolved now."""
        from radixserve.model_executor.loader import auto_tokenizer_class

        if not folder:
            return ""
        if self._early is not None and self._folder == Path(folder):
            return self._early.result()
        return auto_tokenizer_class(Path(folder))


def run_engine_process(input_addr: str, output_addr: str, config: EngineConfig,
                       parent_pid: int | None = None, null_model: bool = False,
                       null_step_s: float = 0.0) -> int:
    """Behind radixserve's frontend: bind, load, handshake, loop. Returns the process exit
    status (0 clean, 1 error)."""
    sockets = CoreSockets(input_addr, output_addr, bind=True, send_timeout_ms=SEND_TIMEOUT_MS)
    tokenizer_class = TokenizerClassProbe(config.model)

    def handshake(engine: Any, _stop: Callable[[], bool]) -> None:
        info = engine.info
        sockets.handshake(timeout_s=HANDSHAKE_TIMEOUT_S, info=msgspec.structs.replace(
            info, pid=os.getpid(), tokenizer_class=tokenizer_class.result(info.folder)))

    try:
        return _serve(sockets, handshake, config, parent_pid, null_model, null_step_s)
    finally:
        sockets.close()
        cleanup_ipc(input_addr, output_addr)


def run_vllm_engine_process(url: str, config: EngineConfig, null_model: bool = False,
                            null_step_s: float = 0.0, shutdown_timeout_s: float = 0.0) -> int:
    """Behind smg, on vLLM's EngineCore wire (``transport.vllm_zmq``): load, then connect to
    smg's handshake at ``url`` (waiting for smg as long as it takes), loop; on exit push
    ``ENGINE_CORE_DEAD`` so smg fails in-flight requests at once and takes a replacement.

    SIGTERM/SIGINT drain first (``EngineLoop.begin_drain``): new requests are refused, the
    running ones finish for up to ``shutdown_timeout_s`` seconds; a second signal stops at
    once.

    Args:
        url: the ``ipc://PATH`` given to smg's ``--worker-urls``, or ``tcp://HOST:PORT``.
        shutdown_timeout_s: the drain's longest wait, seconds (0: stop at once).

    Returns:
        the exit status (0 clean, 1 error).

    Raises:
        ValueError: a URL of another scheme.
    """
    from radixserve.transport.vllm_wire import ready_response
    from radixserve.transport.vllm_zmq import VllmEnginePort

    port = VllmEnginePort(url, send_timeout_ms=SEND_TIMEOUT_MS)

    def handshake(engine: Any, stop: Callable[[], bool]) -> None:
        port.handshake(ready_response(engine.info, config.max_num_seqs,
                                      config.max_num_batched_tokens,
                                      f"radixserve-{os.getpid()}"), stop)

    try:
        return _serve(port, handshake, config, None, null_model, null_step_s,
                      shutdown_timeout_s)
    finally:
        port.close()


def _serve(port: EnginePort, handshake: Callable[[Any, Callable[[], bool]], None],
           config: EngineConfig, parent_pid: int | None, null_model: bool,
           null_step_s: float, drain_s: float = 0.0) -> int:
    """Load the engine, ``handshake(engine, stopped)``, run the loop; SIGTERM and SIGINT stop
    it (during the load or the handshake too; once serving, with ``drain_s`` > 0, the first
    one drains for up to ``drain_s`` seconds). Returns the exit status."""
    loop: EngineLoop | None = None
    pending_signal: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        reason = f"received {signal.Signals(signum).name}"
        if loop is not None and drain_s > 0 and not loop.draining:
            log.info("engine core: %s: draining (up to %g s; a second signal stops at once)",
                     reason, drain_s)
            loop.begin_drain(drain_s)
        elif loop is not None:
            loop.request_stop(reason)
        else:
            pending_signal.append(reason)
            raise KeyboardInterrupt(reason)  # interrupt the model load or the handshake

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        engine = build_engine(config, null_model, null_step_s)
        # everything built so far lives as long as the process: keep the cyclic GC from
        # rescanning it on every collection during serving
        gc.collect()
        gc.freeze()
        handshake(engine, lambda: bool(pending_signal))
    except KeyboardInterrupt:
        log.info("engine core: %s during start-up, exiting", pending_signal or "interrupt")
        return 0
    except Exception as e:  # noqa: BLE001 - any load failure is reported to the frontend
        log.error("engine core failed to start: %s", e)
        port.send_error(f"{type(e).__name__}: {e}")
        return 1
    loop = EngineLoop(engine, port, parent_pid)
    if pending_signal:
        return 0
    log.info("engine core ready: pid %d", os.getpid())
    try:
        reason = loop.run()
    except Exception as e:  # noqa: BLE001 - report, then exit non-zero
        log.error("engine core failed: %s", traceback.format_exc())
        port.send_error(f"{type(e).__name__}: {e}")
        return 1
    log.info("engine core exiting: %s", reason)
    shutdown = getattr(engine, "shutdown", None)
    if shutdown is not None:
        shutdown()  # finish the in-flight step, stop the forward thread
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m radixserve.core.engine_proc",
                                description="radixserve engine-core process (started by serve)")
    p.add_argument("--input", required=True, help="ipc:// address of the input socket")
    p.add_argument("--output", required=True, help="ipc:// address of the output socket")
    p.add_argument("--config", required=True, help="EngineConfig fields as a JSON object")
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--null-model", action="store_true")
    p.add_argument("--null-step-ms", type=float, default=0.0)
    ns = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    configure_logging("info")  # the server's --log-format, inherited in LOG_FORMAT_ENV
    config = EngineConfig(**json.loads(ns.config))
    return run_engine_process(ns.input, ns.output, config, ns.parent_pid, ns.null_model,
                              ns.null_step_ms / 1000)


if __name__ == "__main__":
    sys.exit(main())
