"""The engine core's sockets on smg's ZMQ worker wire (vLLM's EngineCore protocol).

smg is the frontend and binds; the engine connects (vLLM ``EngineCoreProc``; smg
``crates/engine_zmq_client/src/transport.rs``)::

    smg ROUTER tcp://127.0.0.1:P  ◀── DEALER  handshake: HELLO → INIT (addresses) → READY
    smg ROUTER ipc://PATH-in.sock ──▶ DEALER  input: [type byte, msgpack payload]
    smg PULL   ipc://PATH-out.sock ◀── PUSH   output: one msgpack EngineCoreOutputs per step

Both DEALERs carry the identity ``b"\\x00\\x00"`` (engine index 0, little-endian u16); the
registration (vLLM's ``EngineCoreReadyResponse`` map) is the first message on the input socket.
``VllmEnginePort`` is the engine loop's port over these sockets (``core.engine_proc``); message
conversions are in ``vllm_wire``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import msgspec
import zmq

from radixserve.engine_types import (
    FINISH_ABORT,
    EngineRequest,
    RequestRejected,
    SchedulerStats,
    StepOutputs,
    TokenOutput,
)
from radixserve.transport import vllm_wire as vw
from radixserve.transport.messages import AbortRequests, FlushCache
from radixserve.transport.zmq_io import PeerGone

log = logging.getLogger("radixserve.engine")

#: Identity of engine 0 on smg's ROUTER sockets (vLLM: ``index.to_bytes(2, "little")``).
ENGINE_IDENTITY = (0).to_bytes(2, "little")
#: Seconds one HELLO waits for smg's INIT before a fresh handshake socket says HELLO again
#: (smg drops a handshake attempt that fails and binds anew on its next health probe).
INIT_WAIT_S = 30.0
#: Milliseconds a closing output socket keeps trying to deliver (the dead sentinel included).
LINGER_MS = 4000

#: A command for the engine loop: add, answer a rejection, abort, flush.
Command = EngineRequest | TokenOutput | AbortRequests | FlushCache


class VllmEnginePort:
    """The engine loop's port to smg: commands in, one ``EngineCoreOutputs`` per step out.

    Args:
        url: the ``ipc://PATH`` given to smg's ``--worker-urls``, or its handshake address
            ``tcp://HOST:PORT``.
        send_timeout_ms: how long a send may find no smg before ``PeerGone``.

    Raises:
        ValueError: a URL of another scheme.
    """

    def __init__(self, url: str, send_timeout_ms: int = 2000) -> None:
        self.handshake_addr = vw.handshake_address(url)
        self.send_timeout_ms = send_timeout_ms
        self._ctx = zmq.Context()
        self._in: zmq.Socket | None = None
        self._out: zmq.Socket | None = None
        self._enc = msgspec.msgpack.Encoder()
        self._stats = vw.StatsDelta()
        self._dead_sent = False

    # -- start-up ----------------------------------------------------------------------------

    def handshake(self, registration: dict[str, Any], stop: Any = None) -> None:
        """HELLO → INIT → connect input and output → registration → READY.

        Waits for smg as long as it takes (smg may start after the engine), saying HELLO again
        on a fresh socket every ``INIT_WAIT_S``.

        Args:
            registration: ``vllm_wire.ready_response``.
            stop: callable returning True to give up (a signal arrived).

        Raises:
            RuntimeError: INIT without input/output addresses; ``stop`` said so.
        """
        hello = {"status": "HELLO", "local": False, "headless": True}
        while True:
            hs = self._dealer(self.handshake_addr)
            hs.setsockopt(zmq.LINGER, 5000)
            try:
                hs.send(self._enc.encode(hello))
                log.info("engine core: waiting for smg at %s", self.handshake_addr)
                waited = 0.0
                while not hs.poll(200, zmq.POLLIN):
                    waited += 0.2
                    if stop is not None and stop():
                        raise RuntimeError("stopped before smg answered")
                    if waited >= INIT_WAIT_S:
                        break
                else:
                    init = msgspec.msgpack.decode(hs.recv())
                    self._connect(init)
                    self._in.send(self._enc.encode(registration))  # type: ignore[union-attr]
                    hs.send(self._enc.encode({**hello, "status": "READY"}))
                    log.info("engine core: registered with smg (input %s)",
                             init["addresses"]["inputs"][0])
                    return
            finally:
                hs.close()

    def _dealer(self, addr: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, ENGINE_IDENTITY)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(addr)
        return sock

    def _connect(self, init: Any) -> None:
        try:
            inputs, outputs = init["addresses"]["inputs"], init["addresses"]["outputs"]
        except (KeyError, TypeError):
            raise RuntimeError(f"smg's INIT has no input/output addresses: {init!r}") from None
        self._in = self._dealer(inputs[0])
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.SNDHWM, 0)
        self._out.setsockopt(zmq.LINGER, LINGER_MS)
        self._out.setsockopt(zmq.SNDTIMEO, self.send_timeout_ms)
        self._out.connect(outputs[0])

    # -- the engine loop's port --------------------------------------------------------------

    def recv_commands(self, timeout_ms: int | None) -> list[Command]:
        """Every command queued, waiting up to ``timeout_ms`` for the first (0: no wait,
        None: forever). A request smg sent that radixserve cannot take becomes its terminal
        ``TokenOutput`` (``error`` set) for the loop to send back."""
        assert self._in is not None, "handshake first"
        if timeout_ms != 0 and not self._in.poll(timeout_ms, zmq.POLLIN):
            return []
        cmds: list[Command] = []
        while True:
            try:
                frames = self._in.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return cmds
            self._command(frames, cmds)

    def _command(self, frames: list[bytes], cmds: list[Command]) -> None:
        kind = frames[0]
        try:
            payload = msgspec.msgpack.decode(frames[1]) if len(frames) > 1 else None
        except msgspec.DecodeError as e:
            log.error("undecodable message of type %r from smg: %s", kind, e)
            return
        if kind == vw.REQUEST_ADD:
            rid = vw.request_id_of(payload)
            if rid is None:
                log.error("ADD without a request id from smg: %.200r", payload)
                return
            try:
                cmds.append(vw.request_from_vllm(payload))
            except RequestRejected as e:
                log.warning("request %s rejected (%s): %s", rid, e.param, e)
                cmds.append(TokenOutput(request_id=rid, finish_reason=FINISH_ABORT,
                                        error=str(e), error_param=e.param))
                return
            if vw.abort_immediately(payload):
                cmds.append(AbortRequests([rid]))
        elif kind == vw.REQUEST_ABORT:
            ids = [r for r in payload or [] if isinstance(r, str)]
            log.info("Abort %s", " ".join(ids))
            cmds.append(AbortRequests(ids))
        elif kind == vw.REQUEST_UTILITY:
            self._utility(payload, cmds)
        else:
            # START_DP_WAVE only comes with data_parallel_size > 1, which we never register
            log.warning("ignoring message type %r from smg", kind)

    def _utility(self, payload: Any, cmds: list[Command]) -> None:
        try:
            _client, call_id, method, _args = payload
        except (TypeError, ValueError):
            log.error("malformed UTILITY call from smg: %.200r", payload)
            return
        if method == "reset_prefix_cache":
            cmds.append(FlushCache(call_id))
        elif method == "is_sleeping":
            self._send(vw.utility_reply(call_id, False))
        else:
            self._send(vw.utility_reply(call_id, failure=f"utility {method!r} is not "
                                        "supported by radixserve"))

    def send_step(self, step: StepOutputs, stats: SchedulerStats) -> None:
        """One ``EngineCoreOutputs`` for an engine step (with the scheduler's stats).

        Raises:
            PeerGone: smg has been gone for ``send_timeout_ms``.
        """
        self._send(vw.outputs_message(step, self._stats(stats, step.step)))

    def send_flushed(self, call_id: int, pages_freed: int) -> None:
        """Answer ``reset_prefix_cache`` (vLLM's result: True)."""
        self._send(vw.utility_reply(call_id, True))

    def send_error(self, message: str) -> None:
        """The engine failed (the caller has logged ``message``): tell smg with the dead
        sentinel, which fails the in-flight requests; smg has no field for the reason."""
        self.send_dead()

    def send_dead(self) -> None:
        """Push ``ENGINE_CORE_DEAD`` once (no-op before the handshake or when smg is gone)."""
        if self._out is None or self._dead_sent:
            return
        self._dead_sent = True
        with contextlib.suppress(zmq.ZMQError):
            self._out.send(vw.ENGINE_CORE_DEAD, zmq.NOBLOCK)

    def _send(self, msg: list[Any]) -> None:
        assert self._out is not None, "handshake first"
        try:
            self._out.send(self._enc.encode(msg))
        except zmq.Again:
            raise PeerGone("smg is gone (no peer on the output socket)") from None

    def close(self) -> None:
        """Say ``ENGINE_CORE_DEAD`` (smg rebinds for a replacement), close the sockets."""
        self.send_dead()
        for sock in (self._in, self._out):
            if sock is not None:
                sock.close()
        self._ctx.term()
