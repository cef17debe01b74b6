"""Pure ASGI middlewares (no ``BaseHTTPMiddleware``: they must not buffer streamed responses or
swallow the client's disconnect message): API-key auth, the request-body size limit and the
``X-Request-Id`` echo."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from radixserve.entrypoints.openai.errors import OpenAIError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_error(send: Send, err: OpenAIError, headers: list[tuple[bytes, bytes]] = ()
                     ) -> None:
    """Answer with an OpenAI error body straight from a middleware."""
    body = json.dumps(err.to_dict()).encode()
    await send({"type": "http.response.start", "status": err.status_code,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Requests to paths under ``prefix`` need ``Authorization: Bearer <api_key>``; 401 otherwise.

    The comparison is constant-time. Other paths (/health, /metrics, /version) stay open.
    """

    def __init__(self, app: ASGIApp, api_key: str, prefix: str = "/v1") -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and (
                scope["path"] == self.prefix or scope["path"].startswith(self.prefix + "/")):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                await send_error(send, OpenAIError(
                    "Invalid or missing API key: send 'Authorization: Bearer <key>'.", 401,
                    code="invalid_api_key"), [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class BodyTooLarge(OpenAIError):
    """The request body exceeded the limit (413)."""


class BodySizeLimitMiddleware:
    """Request bodies over ``max_bytes`` get 413.

    A ``Content-Length`` over the limit is refused before reading; a body without one (chunked)
    is counted as it streams, and the read fails with ``BodyTooLarge`` (a 413 through the app's
    OpenAIError handler) as soon as it passes the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > limit
            except ValueError:
                await send_error(send, OpenAIError("Invalid Content-Length header."))
                return
            if too_big:
                await send_error(send, self._error(limit))
                return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise self._error(limit)
            return msg

        await self.app(scope, limited_receive, send)

    @staticmethod
    def _error(limit: int) -> BodyTooLarge:
        return BodyTooLarge(f"Request body too large: the limit is {limit} bytes.", 413)


class RequestIdMiddleware:
    """Every response to a request that names itself (``X-Request-Id``) or that a handler
    named (``request.state.request_id``: a generation request's id, the body's ``request_id``
    or a generated one) carries ``X-Request-Id: <id>``, errors included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Starlette's ``request.state`` writes into this dict
        state = scope.setdefault("state", {})
        given = dict(scope["headers"]).get(b"x-request-id")

        async def send_with_id(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                rid = state.get("request_id")
                value = rid.encode("latin-1") if isinstance(rid, str) else given
                if value is not None:
                    msg = {**msg, "headers": [*msg.get("headers", []),
                                              (b"x-request-id", value)]}
            await send(msg)

        await self.app(scope, receive, send_with_id)
