"""``AsyncEngineClient``: the frontend's handle on the engine-core process (DESIGN §1).

It starts ``python -m radixserve.core.engine_proc`` (a fresh interpreter: no fork), handshakes
over the ZMQ sockets, and runs three background pieces on the event loop:

* a reader task: one ``EngineOutputs`` per engine step -> each ``RequestOutput`` goes to the
  ``RequestStream`` that owns its request id (an ``asyncio.Queue``); the latest
  ``SchedulerStats`` is kept for /metrics;
* a sender task: every message to the core goes through one queue, so ``abort`` is a plain
  synchronous call, safe in ``finally`` blocks of cancelled tasks;
* a watcher thread: when the engine process exits unexpectedly, every in-flight stream fails
  with ``EngineDeadError``, ``healthy`` turns False and ``on_fatal`` is called (the server then
  exits non-zero).

A ``RequestStream`` groups the engine requests of one API request (its ``n`` choices, or its
prompts): the handler iterates one stream, and closing it aborts what is still running in the
engine (client disconnects, stop strings, cancellation).
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
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec

from radixserve.config import EngineConfig
from radixserve.sampling_params import SamplingParams
from radixserve.transport.messages import (
    AbortRequests,
    EngineError,
    EngineOutputs,
    EngineRequest,
    RequestOutput,
    SchedulerStats,
    Shutdown,
    pack_ids,
)
from radixserve.transport.zmq_io import AsyncClientSockets, cleanup_ipc, make_ipc_paths

log = logging.getLogger("radixserve.frontend")

#: Seconds the frontend waits for the core's Hello (the model load; a first GGUF conversion
#: can take minutes).
DEFAULT_START_TIMEOUT_S = 900.0
#: Milliseconds the frontend's sockets keep trying to deliver queued messages on close.
CLOSE_LINGER_MS = 200
#: Step-timer samples kept per timer between two /metrics scrapes (``--step-timers``).
MAX_TIMER_SAMPLES = 100_000


class EngineDeadError(RuntimeError):
    """The engine core is gone (crashed, killed, or shutting down)."""


class RequestEncodeError(ValueError):
    """A request cannot be put on the wire (a value MessagePack cannot carry); only that
    request fails, the engine link is untouched."""


@dataclass(frozen=True)
class EngineInfo:
    """What the engine core reported in its Hello.

    Attributes:
        model_name: the model's display name ("SmolLM2-135M-Instruct").
        folder: Hugging Face folder with the tokenizer and chat template.
        max_model_len: longest sequence (prompt + output) in tokens.
        vocab_size: token ids must be below it.
        eos_token_ids: ids that end generation.
        pid: the engine-core process id.
        raw: the whole ``Hello.info`` dict.
    """

    model_name: str
    folder: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    pid: int
    raw: dict

    @classmethod
    def from_hello(cls, info: dict) -> EngineInfo:
        eos = str(info.get("eos_token_ids", ""))
        return cls(
            model_name=str(info["model_name"]), folder=str(info["folder"]),
            max_model_len=int(info["max_model_len"]), vocab_size=int(info["vocab_size"]),
            eos_token_ids=[int(t) for t in eos.split(",") if t.strip()],
            pid=int(info.get("pid", 0)), raw=dict(info))


class RequestStream:
    """The outputs of a group of engine requests, in arrival order.

    Iterate it (``async for out in stream``) until every request finished; each item is a
    ``RequestOutput``. Iteration raises ``EngineDeadError`` if the engine dies. ``finish(rid)``
    ends one request early (aborting it in the engine); ``close()`` aborts every unfinished one
    and is idempotent, synchronous and safe while being cancelled.
    """

    def __init__(self, client: AsyncEngineClient, request_ids: list[str]) -> None:
        self._client = client
        self.request_ids = list(request_ids)
        self.unfinished: set[str] = set(request_ids)
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.closed = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        while self.unfinished:
            out = await self.next()
            if out is not None:
                yield out

    async def next(self) -> RequestOutput | None:
        """The next output of a still-unfinished request (None if it belonged to one that was
        already finished locally).

        Raises:
            EngineDeadError: the engine core died or the server is shutting down.
        """
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.unfinished.clear()
            raise item
        if item.request_id not in self.unfinished:
            return None
        if item.finish_reason is not None:
            self.unfinished.discard(item.request_id)
        return item

    async def next_batch(self) -> list[RequestOutput]:
        """Every output that is ready: waits for one, then takes all that are already queued
        (when the consumer falls behind, several engine steps are handled - and streamed - as
        one). Outputs of requests already finished locally are left out.

        Raises:
            EngineDeadError: the engine core died or the server is shutting down.
        """
        first = await self.next()
        batch = [] if first is None else [first]
        queue = self.queue
        while self.unfinished and not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, BaseException):
                self.unfinished.clear()
                raise item
            if item.request_id not in self.unfinished:
                continue
            if item.finish_reason is not None:
                self.unfinished.discard(item.request_id)
            batch.append(item)
        return batch

    def finish(self, request_id: str) -> None:
        """Treat ``request_id`` as finished now and abort it in the engine (stop strings)."""
        if request_id in self.unfinished:
            self.unfinished.discard(request_id)
            self._client.abort([request_id])

    def close(self) -> None:
        """Abort every unfinished request in the engine and stop routing outputs here."""
        if self.closed:
            return
        self.closed = True
        if self.unfinished:
            self._client.abort(list(self.unfinished))
            self.unfinished.clear()
        self._client._unregister(self.request_ids)

    def _fail(self, exc: BaseException) -> None:
        self.queue.put_nowait(exc)


class AsyncEngineClient:
    """Starts and talks to the engine-core process.

    Args:
        config: the engine configuration (sent to the core as JSON).
        null_model: run the core with ``NullRunner`` (overhead measurements).
        null_step_ms: with ``null_model``, milliseconds each engine step takes (0: instant).
        start_timeout_s: how long ``start`` waits for the model to load.
        on_fatal: called once (on the event loop) when the engine dies unexpectedly, with the
            reason; the server uses it to exit non-zero.

    Attributes:
        info: the core's ``EngineInfo`` once ``start`` returned.
        ready: the handshake completed and the engine is alive.
        draining: ``begin_shutdown`` was called; new requests are refused.
        dead_reason: why the engine is gone (None while alive).
        stats: the latest ``SchedulerStats`` (None before the first step).
    """

    def __init__(self, config: EngineConfig, null_model: bool = False,
                 null_step_ms: float = 0.0, start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.null_model = null_model
        self.null_step_ms = null_step_ms
        self.start_timeout_s = start_timeout_s
        self.on_fatal = on_fatal
        self.info: EngineInfo | None = None
        self.ready = False
        self.draining = False
        self.dead_reason: str | None = None
        self.stats: SchedulerStats | None = None
        self.step_timings: dict[str, list[float]] = {}
        self.proc: subprocess.Popen | None = None
        self._addrs: tuple[str, str] | None = None
        self._sockets: AsyncClientSockets | None = None
        self._streams: dict[str, RequestStream] = {}
        self._send_q: asyncio.Queue = asyncio.Queue()
        self._encoder = msgspec.msgpack.Encoder()
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exited = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    @property
    def healthy(self) -> bool:
        """Ready, not shutting down, and the engine process alive."""
        return self.ready and self.dead_reason is None and not self.draining

    def begin_shutdown(self, reason: str = "server is shutting down") -> None:
        """Refuse new requests (``healthy`` turns False) and fail the in-flight ones at once,
        aborting them in the engine; ``shutdown`` then stops the engine."""
        self.draining = True
        self.fail_in_flight(reason)

    @property
    def num_in_flight(self) -> int:
        """Engine requests with a stream waiting for outputs."""
        return len(self._streams)

    async def start(self) -> EngineInfo:
        """Spawn the engine core, wait for its model to load and handshake.

        Raises:
            RuntimeError: the core failed to start (its error message), exited, timed out, or
                speaks another schema version.
        """
        self._loop = asyncio.get_running_loop()
        self._addrs = make_ipc_paths(tempfile.mkdtemp(prefix="radixserve-"))
        cmd = [sys.executable, "-m", "radixserve.core.engine_proc",
               "--input", self._addrs[0], "--output", self._addrs[1],
               "--parent-pid", str(os.getpid()),
               "--config", json.dumps(dataclasses.asdict(self.config))]
        if self.null_model:
            cmd += ["--null-model", "--null-step-ms", str(self.null_step_ms)]
        # its own session: a Ctrl-C in the terminal reaches only the frontend, which then
        # shuts the core down in order
        self.proc = subprocess.Popen(cmd, start_new_session=True)
        log.info("engine core process started: pid %d", self.proc.pid)
        threading.Thread(target=self._watch_process, name="engine-watch", daemon=True).start()
        self._sockets = AsyncClientSockets(*self._addrs, linger_ms=CLOSE_LINGER_MS)
        handshake = asyncio.ensure_future(self._sockets.handshake(self.start_timeout_s))
        exited = asyncio.ensure_future(self._exited.wait())
        try:
            await asyncio.wait({handshake, exited}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            handshake.cancel()
            exited.cancel()
            raise
        exited.cancel()
        if not handshake.done():
            handshake.cancel()
            raise RuntimeError(
                f"engine core exited with code {self.proc.poll()} while starting")
        hello = handshake.result()  # raises RuntimeError on EngineError / version mismatch
        self.info = EngineInfo.from_hello(hello.info)
        self._tasks = [asyncio.ensure_future(self._read_loop()),
                       asyncio.ensure_future(self._send_loop())]
        self.ready = True
        return self.info

    def _watch_process(self) -> None:
        proc, loop = self.proc, self._loop
        assert proc is not None and loop is not None
        rc = proc.wait()
        with contextlib.suppress(RuntimeError):  # loop already closed
            loop.call_soon_threadsafe(self._on_process_exit, rc)

    def _on_process_exit(self, rc: int) -> None:
        self._exited.set()
        if not self._closing:
            self._die(f"engine core process exited unexpectedly with code {rc}")

    def _die(self, reason: str) -> None:
        """Fail every in-flight request; mark unhealthy; tell the server (once)."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        log.error("%s", reason)
        self._fail_all(EngineDeadError(reason))
        if self.on_fatal is not None and not self._closing:
            self.on_fatal(reason)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream._fail(exc)
        self._streams.clear()

    def fail_in_flight(self, reason: str) -> None:
        """Abort every in-flight request in the engine and fail its stream (shutdown)."""
        ids = list(self._streams)
        self._fail_all(EngineDeadError(reason))
        if ids:
            self._send_nowait(AbortRequests(ids))

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Abort everything, ask the core to exit, wait up to ``timeout_s`` (then kill it),
        close the sockets and remove the IPC files. Idempotent."""
        if self._closing:
            return
        self._closing = True
        self.ready = False
        self.fail_in_flight("server is shutting down")
        proc = self.proc
        if proc is not None and proc.poll() is None:
            if self._tasks:
                self._send_nowait(Shutdown())
                await self._flush_sends(0.5)
            else:
                proc.terminate()  # still loading the model: SIGTERM interrupts the load
            try:
                await asyncio.wait_for(self._exited.wait(), timeout_s)
            except asyncio.TimeoutError:
                log.warning("engine core did not exit within %.1f s: killing it", timeout_s)
                proc.kill()
        if proc is not None:
            await asyncio.to_thread(proc.wait)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._sockets is not None:
            self._sockets.close()
            self._sockets = None
        if self._addrs is not None:
            cleanup_ipc(*self._addrs)

    # ------------------------------------------------------------------ requests
    def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]],
                     arrival_time: float | None = None) -> RequestStream:
        """Send engine requests and return the stream of their outputs.

        Args:
            requests: ``(request_id, prompt_token_ids, sampling_params)`` each; ids unique.
            arrival_time: ``time.time()`` of the API request (default: now).

        Raises:
            EngineDeadError: the engine is not running.
            RequestEncodeError: a request cannot be encoded (nothing was sent).
        """
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine core is not ready")
        assert self.info is not None
        stream = RequestStream(self, [r[0] for r in requests])
        now = time.time() if arrival_time is None else arrival_time
        for rid, _, _ in requests:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in flight")
        # encoded here, not in the sender task: a value that cannot go on the wire fails this
        # API request alone instead of breaking the link every other request shares
        bufs = []
        for rid, ids, sp in requests:
            try:
                bufs.append(self._encoder.encode(EngineRequest(
                    rid, pack_ids(ids), sp, self.info.eos_token_ids, now)))
            except (OverflowError, TypeError, msgspec.EncodeError) as e:
                raise RequestEncodeError(f"request cannot be sent to the engine: {e}") from None
        for (rid, _, _), buf in zip(requests, bufs, strict=True):
            self._streams[rid] = stream
            self._send_nowait(buf)
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling_params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes; stopping early aborts it in the engine.

        Raises:
            EngineDeadError: the engine died.
        """
        stream = self.add_requests([(request_id, prompt_token_ids, sampling_params)])
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests in the engine (no notification comes back); never blocks."""
        if request_ids and self.dead_reason is None and not self._closing:
            self._send_nowait(AbortRequests(list(request_ids)))
        self._unregister(request_ids)

    def _unregister(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)

    # ------------------------------------------------------------------ background tasks
    def _send_nowait(self, msg: object) -> None:
        self._send_q.put_nowait(msg)

    async def _send_loop(self) -> None:
        assert self._sockets is not None
        sockets = self._sockets
        while True:
            msg = await self._send_q.get()
            try:
                if isinstance(msg, bytes):
                    await sockets.send_encoded(msg)
                else:
                    await sockets.send(msg)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the link is broken: nothing can go on
                self._die(f"cannot send to the engine core: {type(e).__name__}: {e}")
                return
            finally:
                self._send_q.task_done()

    async def _flush_sends(self, timeout_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._send_q.join(), timeout_s)

    async def _read_loop(self) -> None:
        try:
            await self._read_outputs()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - undecodable message, broken socket
            self._die(f"lost the engine core's output stream: {type(e).__name__}: {e}")

    async def _read_outputs(self) -> None:
        assert self._sockets is not None
        sockets = self._sockets
        streams = self._streams
        while True:
            msg = await sockets.recv()
            if isinstance(msg, EngineOutputs):
                if msg.stats is not None:
                    self.stats = msg.stats
                    for k, v in msg.stats.step_timings.items():
                        samples = self.step_timings.setdefault(k, [])
                        if len(samples) < MAX_TIMER_SAMPLES:  # nobody scrapes: stay bounded
                            samples.extend(v)
                for out in msg.all_outputs():
                    stream = streams.get(out.request_id)
                    if stream is None:
                        continue
                    stream.queue.put_nowait(out)
                    if out.finish_reason is not None:
                        del streams[out.request_id]
            elif isinstance(msg, EngineError):
                self._die(f"engine core failed: {msg.message}")
                return

    def drain_step_timings(self) -> dict[str, list[float]]:
        """Step timer samples received since the last call (for /metrics)."""
        out, self.step_timings = self.step_timings, {}
        return out
