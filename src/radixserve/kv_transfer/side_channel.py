"""The side channel between a decode and a prefill instance: ZeroMQ REQ -> ROUTER over TCP,
msgspec MessagePack messages (vLLM's NIXL handshake listener has the same shape: a ROUTER
thread on the prefill side answering a metadata request).

Calls: ``Hello`` (handshake: compatibility factors, the KV layout, the transport's metadata),
``Claim`` / ``Done`` / ``Release`` (a lease's life, ``lease.py``) and ``Read`` (the TCP
connector's page read: the reply's extra frames are the pages' bytes, one per layer).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from radixserve.kv_transfer.compat import KVLayout

log = logging.getLogger("radixserve.kv_transfer")


class Hello(msgspec.Struct, tag="hello"):
    """Handshake request: the caller's compatibility factors and role."""

    factors: dict[str, Any]
    connector: str
    role: str = "decode"


class HelloReply(msgspec.Struct, tag="hello_reply"):
    """Handshake answer. ``ok`` False: refused, ``reason`` says why."""

    ok: bool
    reason: str = ""
    engine_id: str = ""
    factors: dict[str, Any] = {}
    layout: KVLayout | None = None
    transport: bytes = b""


class Claim(msgspec.Struct, tag="claim"):
    """About to read ``pages`` of the lease of prefill request ``request_id``."""

    request_id: str
    pages: list[int]


class Read(msgspec.Struct, tag="read"):
    """Send ``pages`` of a claimed lease (TCP connector): one frame per layer, each
    ``[2, len(pages), page_size, heads, dim]`` in the KV dtype."""

    request_id: str
    pages: list[int]


class Done(msgspec.Struct, tag="done"):
    """The read is complete: end the lease. Answer "ok" only if it was held throughout."""

    request_id: str


class Release(msgspec.Struct, tag="release"):
    """End the lease without reading (aborted request, or a full local prefix hit)."""

    request_id: str


class Reply(msgspec.Struct, tag="reply"):
    """Answer to Claim / Read / Done / Release: "ok", or why not."""

    status: str
    detail: str = ""


Message = Hello | HelloReply | Claim | Read | Done | Release | Reply
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)

#: A handler answers one message with a reply and extra frames (buffers) to send after it.
Handler = Callable[[Any], tuple[Any, list[Any]]]


class SideChannelError(RuntimeError):
    """The peer did not answer in time, or answered nonsense."""


class SideChannelServer:
    """A ROUTER socket on ``tcp://host:port`` served by a daemon thread.

    Args:
        ctx: the ZeroMQ context.
        host: address to bind (also what peers are told).
        port: TCP port; 0 binds a free one (``port`` is then the chosen one).
        handler: answers each request; an exception becomes a Reply("error", message).

    Raises:
        zmq.ZMQError: the address cannot be bound.
    """

    def __init__(self, ctx: zmq.Context, host: str, port: int, handler: Handler) -> None:
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host, self.port = host, port
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="radixserve-kv-side-channel",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, empty, payload = sock.recv_multipart(copy=False)[:3]
            try:
                msg = _decoder.decode(payload.buffer)
                reply, frames = self._handler(msg)
            except Exception as e:  # noqa: BLE001 - a bad request must not stop the server
                log.warning("kv side channel: request failed: %s", e)
                reply, frames = Reply("error", f"{type(e).__name__}: {e}"), []
            sock.send_multipart([ident, empty, _encoder.encode(reply), *frames], copy=False)
        sock.close()

    def close(self) -> None:
        """Stop serving and close the socket (within ~0.1 s)."""
        self._stop.set()
        self._thread.join(timeout=2)


def call(ctx: zmq.Context, host: str, port: int, msg: Any, timeout_s: float
         ) -> tuple[Any, list[zmq.Frame]]:
    """One request to a peer's side channel on a fresh REQ socket.

    Returns:
        (the decoded reply, its extra frames).

    Raises:
        SideChannelError: no answer within ``timeout_s`` seconds (the peer is gone, or
            unreachable), or an undecodable one.
    """
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(_encoder.encode(msg))
        if not sock.poll(int(timeout_s * 1000)):
            raise SideChannelError(f"no answer from {host}:{port} within {timeout_s:g} s")
        parts = sock.recv_multipart(copy=False)
        try:
            reply = _decoder.decode(parts[0].buffer)
        except msgspec.DecodeError as e:
            raise SideChannelError(f"bad answer from {host}:{port}: {e}") from None
        return reply, parts[1:]
    finally:
        sock.close()
