"""``AsyncEngineClient``: the frontend's handle on the engine core (DESIGN §1).

It starts the engine-core process (``EngineProcess``), handshakes over the ZMQ sockets, and
runs two tasks on the event loop:

* the output reader: one ``engine_types.StepOutputs`` per engine step
  (the decode column stays an int32 array) -> the ``OutputProcessor`` -> each
  ``RequestDelta`` to the ``RequestStream`` that owns its request (an ``asyncio.Queue``);
  requests a stop string finished are aborted in the engine; the latest ``SchedulerStats``
  and the step timer samples are kept for /metrics (vLLM's AsyncLLM output handler);
* the sender: every message to the core goes through one queue, so ``abort`` is a plain
  synchronous call, safe in ``finally`` blocks of cancelled tasks.

When the engine process exits unexpectedly, every in-flight stream fails with
``EngineDeadError``, ``healthy`` turns False and ``on_fatal`` is called (the server then exits
non-zero).

A ``RequestStream`` groups the engine requests of one API request (its ``n`` choices, or its
prompts): the handler iterates one stream, and closing it aborts what is still running in the
engine (client disconnects, errors, cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from radixserve.config import EngineConfig
from radixserve.engine_types import EngineInfo, EngineRequest, SchedulerStats, StepOutputs
from radixserve.frontend.engine_process import EngineProcess
from radixserve.frontend.output_processor import OutputProcessor, RequestDelta, RequestState
from radixserve.transport.messages import (
    AbortRequests,
    EngineError,
    FlushCache,
    FlushCacheDone,
    Shutdown,
    encoder,
)
from radixserve.transport.zmq_io import AsyncClientSockets

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


class RequestStream:
    """The deltas of a group of engine requests, in arrival order.

    Attributes:
        states: the requests' ``RequestState``s, in the order they were added (``index`` is
            the position here): totals and timings for the final response.
        request_ids: their engine request ids, in the same order.
    """

    def __init__(self, client: AsyncEngineClient, states: list[RequestState]) -> None:
        self._client = client
        self.states = states
        self.request_ids = [s.request_id for s in states]
        self.queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._unfinished = len(states)
        self.closed = False

    @property
    def finished(self) -> bool:
        """Every request of the stream has delivered its last delta (or the stream failed)."""
        return self._unfinished == 0

    async def next_batch(self) -> list[RequestDelta]:
        """Every delta that is ready: waits for one, then takes all that are already queued
        (when the consumer falls behind, several engine steps are handled - and streamed - as
        one). Call only while not ``finished``.

        Raises:
            EngineDeadError: the engine core died or the server is shutting down.
        """
        queue = self.queue
        item = await queue.get()
        batch: list[RequestDelta] = []
        while True:
            if isinstance(item, BaseException):
                self._unfinished = 0
                raise item
            batch.append(item)
            if item.finish_reason is not None:
                self._unfinished -= 1
            if queue.empty():
                return batch
            item = queue.get_nowait()

    def close(self) -> None:
        """Abort every unfinished request in the engine and stop routing deltas here;
        idempotent, synchronous, safe while being cancelled."""
        if self.closed:
            return
        self.closed = True
        self._client.abort([s.request_id for s in self.states if s.finish_reason is None])

    def cancel(self, exc: BaseException) -> None:
        """``close``, and make the consumer's pending (or next) ``next_batch`` raise ``exc``
        (an out-of-band abort, e.g. the gRPC ``Abort`` RPC, ends the consumer too)."""
        self.close()
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.queue.put_nowait(exc)


class AsyncEngineClient:
    """Starts and talks to the engine core.

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
        draining: ``begin_drain`` or ``begin_shutdown`` was called: ``healthy`` is False (the
            server refuses new API requests; gateways stop routing here).
        dead_reason: why the engine is gone (None while alive).
        stats: the latest ``SchedulerStats`` (None before the first step).
        busy_s: seconds the engine had running requests (summed between step messages);
            with ``stats.generation_tokens`` it gives the decode rate a gateway routes by.
    """

    def __init__(self, config: EngineConfig, null_model: bool = False,
                 null_step_ms: float = 0.0, start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
                 on_fatal: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.process = EngineProcess(config, null_model, null_step_ms)
        self.start_timeout_s = start_timeout_s
        self.on_fatal = on_fatal
        self.info: EngineInfo | None = None
        self.ready = False
        self.draining = False
        self.dead_reason: str | None = None
        self.stats: SchedulerStats | None = None
        self.step_timings: dict[str, list[float]] = {}
        self._processor: OutputProcessor | None = None
        self._sockets: AsyncClientSockets | None = None
        self._streams: dict[str, RequestStream] = {}
        self._send_q: asyncio.Queue[bytes | Any] = asyncio.Queue()
        self._encoder = encoder()
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._stopping = False
        self.busy_s = 0.0
        self._stats_at = 0.0
        self._calls: dict[int, asyncio.Future[int]] = {}
        self._next_call_id = 0

    # ------------------------------------------------------------------ lifecycle
    @property
    def healthy(self) -> bool:
        """Ready, not shutting down, and the engine process alive."""
        return self.ready and self.dead_reason is None and not self.draining

    @property
    def num_in_flight(self) -> int:
        """Engine requests with a stream waiting for deltas."""
        return len(self._streams)

    async def start(self) -> EngineInfo:
        """Spawn the engine core, wait for its model to load and handshake.

        Raises:
            RuntimeError: the core failed to start (its error message), exited, timed out, or
                speaks another schema version.
        """
        addrs = self.process.start(on_exit=self._on_process_exit)
        self._sockets = AsyncClientSockets(*addrs, linger_ms=CLOSE_LINGER_MS)
        handshake = asyncio.ensure_future(self._sockets.handshake(self.start_timeout_s))
        exited = asyncio.ensure_future(self.process.exited.wait())
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
                f"engine core exited with code {self.process.returncode} while starting")
        hello = handshake.result()  # raises RuntimeError on EngineError / version mismatch
        if hello.info is None:
            raise RuntimeError("the engine core's Hello carries no EngineInfo")
        self.info = hello.info
        self._tasks = [asyncio.ensure_future(self._read_loop()),
                       asyncio.ensure_future(self._send_loop())]
        self.ready = True
        return self.info

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Give the client the transformers tokenizer its output processor detokenizes with
        (the server loads it after ``start``: the engine names the folder)."""
        self._processor = OutputProcessor(tokenizer)

    def begin_drain(self) -> None:
        """Stop admitting (``healthy`` turns False, so /health answers 503 and gateways route
        elsewhere) while the requests in flight keep running; ``add_requests`` still takes
        the requests an API handler admitted before. ``begin_shutdown`` ends the drain."""
        self.draining = True

    def begin_shutdown(self, reason: str = "server is shutting down") -> None:
        """Refuse new requests (``healthy`` turns False) and fail the in-flight ones at once,
        aborting them in the engine; ``shutdown`` then stops the engine."""
        self.draining = True
        self._stopping = True
        self.fail_in_flight(reason)

    def fail_in_flight(self, reason: str) -> None:
        """Abort every in-flight request in the engine and fail its stream (shutdown)."""
        ids = list(self._streams)
        self._fail_all(EngineDeadError(reason))
        if ids and self.dead_reason is None:
            self._send_q.put_nowait(AbortRequests(ids))

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        """Abort everything, ask the core to exit, wait up to ``timeout_s`` (then kill it),
        close the sockets and remove the IPC files. Idempotent."""
        if self._closing:
            return
        self._closing = True
        self.ready = False
        self.fail_in_flight("server is shutting down")
        process = self.process
        if process.alive:
            if self._tasks:
                self._send_q.put_nowait(Shutdown())
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._send_q.join(), 0.5)
            else:
                process.terminate()  # still loading the model: SIGTERM interrupts the load
        await process.wait(timeout_s)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._sockets is not None:
            self._sockets.close()
            self._sockets = None
        process.cleanup()

    def _on_process_exit(self, rc: int) -> None:
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
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(exc)
        streams = {id(s): s for s in self._streams.values()}.values()
        if self._processor is not None:
            self._processor.abort_requests(list(self._streams))
        self._streams.clear()
        for stream in streams:
            stream._fail(exc)

    # ------------------------------------------------------------------ requests
    def add_requests(self, requests: Sequence[EngineRequest]) -> RequestStream:
        """Send engine requests (``n`` 1 each; ``eos_token_ids`` is not sent: the core uses
        the model's) and return the stream of their deltas; ``index`` of each request's state
        is its position in ``requests``.

        Raises:
            EngineDeadError: the engine is not running.
            RequestEncodeError: a request cannot be encoded (nothing was sent).
            ValueError: a request id is already in flight.
        """
        # a drain still takes what the API handlers admitted before it began
        if not self.ready or self.dead_reason is not None or self._stopping:
            raise EngineDeadError(self.dead_reason or ("server is shutting down" if
                                                       self._stopping else
                                                       "the engine core is not ready"))
        processor = self._processor
        if processor is None:
            raise RuntimeError("set_tokenizer must be called before add_requests")
        for r in requests:
            if r.request_id in self._streams:
                raise ValueError(f"request id {r.request_id!r} is already in flight")
        # encoded here, not in the sender task: a value that cannot go on the wire fails this
        # API request alone instead of breaking the link every other request shares
        bufs = []
        for r in requests:
            try:
                bufs.append(self._encoder.encode(r))
            except (OverflowError, TypeError, UnicodeEncodeError, msgspec.EncodeError) as e:
                raise RequestEncodeError(f"request cannot be sent to the engine: {e}") from None
        states: list[RequestState] = []
        try:
            for i, r in enumerate(requests):
                states.append(processor.add_request(r.request_id, r.prompt_token_ids,
                                                    r.sampling_params, r.arrival_time, index=i))
        except ValueError:
            processor.abort_requests([s.request_id for s in states])
            raise
        stream = RequestStream(self, states)
        for r, buf in zip(requests, bufs, strict=True):
            self._streams[r.request_id] = stream
            self._send_q.put_nowait(buf)
        return stream

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests in the engine (no notification comes back) and stop tracking them;
        never blocks."""
        if not request_ids:
            return
        if self.dead_reason is None and not self._closing:
            self._send_q.put_nowait(AbortRequests(list(request_ids)))
        if self._processor is not None:
            self._processor.abort_requests(request_ids)
        for rid in request_ids:
            self._streams.pop(rid, None)

    async def flush_cache(self) -> int:
        """Evict every radix-cache entry no live request holds, in the engine core; returns
        the number of KV pages freed. Live requests are not disturbed.

        Raises:
            EngineDeadError: the engine is not running (or died before answering).
        """
        if not self.healthy:
            raise EngineDeadError(self.dead_reason or "the engine core is not ready")
        call_id = self._next_call_id
        self._next_call_id += 1
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._send_q.put_nowait(FlushCache(call_id))
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    # ------------------------------------------------------------------ background tasks
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
            if isinstance(msg, StepOutputs):
                if msg.stats is not None:
                    self._keep_stats(msg.stats)
                processor = self._processor
                if processor is None or not (msg.outputs or msg.decode_request_ids):
                    continue
                processed = processor.process(msg)
                if processed.abort_ids:
                    self._send_q.put_nowait(AbortRequests(processed.abort_ids))
                for d in processed.deltas:
                    stream = streams.get(d.request_id)
                    if stream is None:
                        continue
                    stream.queue.put_nowait(d)
                    if d.finish_reason is not None:
                        del streams[d.request_id]
            elif isinstance(msg, FlushCacheDone):
                fut = self._calls.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg.pages_freed)
            elif isinstance(msg, EngineError):
                self._die(f"engine core failed: {msg.message}")
                return

    def _keep_stats(self, stats: SchedulerStats) -> None:
        now = time.monotonic()
        if self.stats is not None and self.stats.num_running:
            self.busy_s += now - self._stats_at  # the engine had work since the last step
        self._stats_at = now
        self.stats = stats
        for k, v in stats.step_timings.items():
            samples = self.step_timings.setdefault(k, [])
            if len(samples) < MAX_TIMER_SAMPLES:  # nobody scrapes: stay bounded
                samples.extend(v)

    def drain_step_timings(self) -> dict[str, list[float]]:
        """Step timer samples received since the last call (for /metrics)."""
        out, self.step_timings = self.step_timings, {}
        return out
