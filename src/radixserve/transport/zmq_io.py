"""ZMQ + msgspec plumbing for the two sockets between the frontend and the engine core.

::

    frontend  PUSH ──(input: ClientMessage)──▶ PULL  engine core
    frontend  PULL ◀──(output: CoreMessage)─── PUSH  engine core

Both sockets are IPC sockets in a private directory; by default the core binds and the frontend
connects (either may start first: ZMQ reconnects). Messages are MessagePack via msgspec tagged
unions; there is no pickle anywhere. The first message each way is ``Hello`` with the schema
version (``handshake``). High-water marks are 0 (unbounded) so a send never drops a message.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from radixserve.engine_types import EngineInfo, EngineRequest, SchedulerStats, StepOutputs
from radixserve.transport.messages import (
    SCHEMA_VERSION,
    AbortRequests,
    ClientMessage,
    CoreMessage,
    EngineError,
    FlushCache,
    FlushCacheDone,
    Hello,
    Shutdown,
    decoder,
    encoder,
)

#: Longest IPC socket path the OS accepts (sun_path is 108 bytes on Linux, less elsewhere).
MAX_IPC_PATH = 100
#: Milliseconds a closing socket keeps trying to deliver queued messages.
DEFAULT_LINGER_MS = 1000


# -- addresses -----------------------------------------------------------------------------------


def make_ipc_paths(run_dir: str | os.PathLike[str] | None = None) -> tuple[str, str]:
    """Return ``(input_address, output_address)``, two ``ipc://`` addresses in a private dir.

    Args:
        run_dir: directory for the socket files; created with mode 0700 if missing. When None, a
            fresh ``tempfile.mkdtemp`` directory (mode 0700) is used.

    Raises:
        ValueError: the paths would be too long for a Unix socket.
    """
    if run_dir is None:
        directory = Path(tempfile.mkdtemp(prefix="radixserve-"))
    else:
        directory = Path(run_dir)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = (directory / "input.sock", directory / "output.sock")
    for p in paths:
        if len(str(p)) > MAX_IPC_PATH:
            raise ValueError(f"IPC socket path too long ({len(str(p))} > {MAX_IPC_PATH}): {p}")
    return tuple(f"ipc://{p}" for p in paths)  # type: ignore[return-value]


def cleanup_ipc(*addresses: str) -> None:
    """Remove the socket files of ``ipc://`` addresses, then their directories if empty.

    Never raises for files that are already gone; other addresses are ignored.
    """
    dirs = []
    for addr in addresses:
        if not addr.startswith("ipc://"):
            continue
        path = Path(addr[len("ipc://") :])
        path.unlink(missing_ok=True)
        dirs.append(path.parent)
    for d in dict.fromkeys(dirs):
        with contextlib.suppress(OSError):  # not empty (or shared): leave it
            d.rmdir()


# -- handshake -----------------------------------------------------------------------------------


def check_hello(msg: object, peer: str) -> Hello:
    """Return ``msg`` if it is a ``Hello`` with our schema version, else raise RuntimeError."""
    if isinstance(msg, EngineError):
        raise RuntimeError(f"{peer} failed before the handshake: {msg.message}")
    if not isinstance(msg, Hello):
        raise RuntimeError(f"{peer} sent {type(msg).__name__} before Hello")
    if msg.schema_version != SCHEMA_VERSION:
        raise RuntimeError(
            f"wire schema mismatch: {peer} speaks schema_version={msg.schema_version}, "
            f"this process speaks {SCHEMA_VERSION}; run the same radixserve version on both sides"
        )
    return msg


def _decode_first(decoder: msgspec.msgpack.Decoder, buf: bytes, peer: str) -> Hello:
    """Decode the first message of a connection, explaining a version mismatch clearly even when
    the peer's Hello does not fit our schema."""
    try:
        msg = decoder.decode(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        try:
            raw = msgspec.msgpack.decode(buf)
        except msgspec.DecodeError:
            raw = None
        if isinstance(raw, list) and len(raw) >= 2 and raw[0] == "hello":
            return check_hello(Hello(schema_version=raw[1]), peer)
        raise RuntimeError(f"{peer} sent an undecodable first message: {exc}") from exc
    return check_hello(msg, peer)


def _configure(sock: zmq.Socket, linger_ms: int) -> None:
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


def _open(sock: zmq.Socket, addr: str, bind: bool) -> None:
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)


# -- engine-core side (blocking) -----------------------------------------------------------------


class PeerGone(RuntimeError):
    """A send found no peer on the output socket for ``send_timeout_ms``: the frontend is gone
    (a PUSH socket without a peer blocks instead of queueing, whatever its high-water mark)."""


class CoreSockets:
    """The engine core's end: PULL ``ClientMessage`` from input, PUSH ``CoreMessage`` to output.

    Args:
        input_addr / output_addr: from ``make_ipc_paths``.
        bind: bind both sockets (default) rather than connect.
        linger_ms: how long ``close`` waits to flush queued output.
        send_timeout_ms: how long ``send`` may wait for a peer before raising ``PeerGone``
            (None: forever).
    """

    def __init__(
        self, input_addr: str, output_addr: str, bind: bool = True,
        linger_ms: int = DEFAULT_LINGER_MS, send_timeout_ms: int | None = None,
    ) -> None:
        self.input_addr, self.output_addr = input_addr, output_addr
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PULL)
        self._out = self._ctx.socket(zmq.PUSH)
        for sock, addr in ((self._in, input_addr), (self._out, output_addr)):
            _configure(sock, linger_ms)
            _open(sock, addr, bind)
        if send_timeout_ms is not None:
            self._out.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
        self._enc = encoder()
        self._dec = decoder(ClientMessage)

    def recv(self, timeout_ms: int | None = None) -> ClientMessage | None:
        """Next message from the frontend.

        Blocks until one arrives (``timeout_ms=None``), for at most ``timeout_ms`` ms (returns
        None on timeout), or not at all (``timeout_ms=0``).
        """
        if timeout_ms is not None and not self._in.poll(timeout_ms, zmq.POLLIN):
            return None
        return self._dec.decode(self._in.recv())

    def recv_nowait(self) -> list[ClientMessage]:
        """Every message already queued, oldest first; never blocks."""
        msgs = []
        while True:
            try:
                buf = self._in.recv(zmq.NOBLOCK)
            except zmq.Again:
                return msgs
            msgs.append(self._dec.decode(buf))

    def send(self, msg: CoreMessage) -> None:
        """Queue one message for the frontend; does not block while it is connected (unbounded
        high-water mark).

        Raises:
            PeerGone: no frontend connected for ``send_timeout_ms``.
        """
        buf = self._enc.encode(msg)
        try:
            self._out.send(buf, copy=len(buf) < 65536)
        except zmq.Again:
            raise PeerGone("no frontend on the output socket") from None

    # the engine loop's port (core.engine_proc.EngineLoop): commands in, steps out

    def recv_commands(self, timeout_ms: int | None
                      ) -> list[EngineRequest | AbortRequests | FlushCache | Shutdown]:
        """Every command queued, waiting up to ``timeout_ms`` for the first (0: no wait, None:
        forever); repeated Hellos dropped."""
        first = self.recv(timeout_ms)
        if first is None:
            return []
        return [m for m in (first, *self.recv_nowait()) if not isinstance(m, Hello)]

    def send_step(self, step: StepOutputs, stats: SchedulerStats) -> None:
        """An engine step's ``StepOutputs``, the scheduler's stats attached."""
        step.stats = stats
        self.send(step)

    def send_flushed(self, call_id: int, pages_freed: int) -> None:
        """Answer a ``FlushCache``."""
        self.send(FlushCacheDone(call_id, pages_freed))

    def send_error(self, message: str) -> None:
        """The engine failed: the frontend fails in-flight requests and exits non-zero."""
        with contextlib.suppress(PeerGone):  # nobody left to tell
            self.send(EngineError(message))

    def handshake(self, timeout_s: float = 60.0, info: EngineInfo | None = None) -> Hello:
        """Wait for the frontend's Hello, check its schema version, answer with ours (carrying
        ``info``, the engine's facts).

        Blocks up to ``timeout_s``. On a version mismatch our Hello is still sent (so the frontend
        can report it too) before raising.

        Raises:
            RuntimeError: timeout, a first message that is not Hello, or a schema mismatch.
        """
        if not self._in.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise RuntimeError(f"no Hello from the frontend within {timeout_s:.0f} s")
        buf = self._in.recv()
        self.send(Hello(schema_version=SCHEMA_VERSION, info=info))
        return _decode_first(self._dec, buf, "frontend")

    def close(self) -> None:
        """Close both sockets and the context (waits up to linger for queued output)."""
        self._in.close()
        self._out.close()
        self._ctx.term()


# -- frontend side (asyncio) ---------------------------------------------------------------------


class AsyncClientSockets:
    """The frontend's end: PUSH ``ClientMessage`` to input, PULL ``CoreMessage`` from output.

    Uses ``zmq.asyncio``; create it inside the running event loop.

    Args:
        input_addr / output_addr: the same addresses the core uses.
        bind: bind rather than connect (default: connect, the core binds).
        linger_ms: how long ``close`` waits to flush queued requests.
    """

    def __init__(
        self, input_addr: str, output_addr: str, bind: bool = False,
        linger_ms: int = DEFAULT_LINGER_MS,
    ) -> None:
        self.input_addr, self.output_addr = input_addr, output_addr
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)  # the core's input
        self._out = self._ctx.socket(zmq.PULL)  # the core's output
        for sock, addr in ((self._in, input_addr), (self._out, output_addr)):
            _configure(sock, linger_ms)
            _open(sock, addr, bind)
        self._enc = encoder()
        self._dec = decoder(CoreMessage)

    async def send(self, msg: ClientMessage) -> None:
        """Queue one message for the core; returns at once (unbounded high-water mark)."""
        await self._in.send(self._enc.encode(msg))

    async def send_encoded(self, buf: bytes) -> None:
        """Queue one ``ClientMessage`` already encoded with a ``msgspec.msgpack.Encoder`` (see
        ``send``)."""
        await self._in.send(buf)

    async def recv(self) -> CoreMessage:
        """Wait (without blocking the event loop) for the next message from the core."""
        return self._dec.decode(await self._out.recv())

    async def handshake(self, timeout_s: float = 60.0) -> Hello:
        """Send our Hello and wait up to ``timeout_s`` for the core's, checking its version.

        Raises:
            RuntimeError: timeout, the core reported an EngineError, or a schema mismatch.
        """
        await self.send(Hello(schema_version=SCHEMA_VERSION))
        try:
            buf = await asyncio.wait_for(self._out.recv(), timeout_s)
        except asyncio.TimeoutError:
            raise RuntimeError(f"no Hello from the engine core within {timeout_s:.0f} s") from None
        return _decode_first(self._dec, buf, "engine core")

    def close(self) -> None:
        """Close both sockets and the context (waits up to linger for queued requests)."""
        self._in.close()
        self._out.close()
        self._ctx.term()
