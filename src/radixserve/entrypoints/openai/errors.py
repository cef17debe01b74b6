"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

#: Default ``type`` for each HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


def _encodable(text: str) -> str:
    """``text`` with any lone surrogate written as its ``\\udXXX`` escape: an error that
    quotes the client's input (an unknown field's name, a dict key in ``param``) must still
    encode as the UTF-8 JSON body."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class OpenAIError(Exception):
    """An error to return to the client as an OpenAI error body.

    Args:
        message: human-readable explanation.
        status_code: HTTP status (400 by default).
        type: OpenAI error type; derived from the status when None.
        param: the request field at fault, dotted (``messages.0.role``), or None.
        code: optional machine-readable code (e.g. ``"model_not_found"``).
        headers: extra response headers (a draining server's 503 sends ``Retry-After``).
    """

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = _encodable(message)
        super().__init__(message)
        self.headers = headers
        self.message = message
        self.status_code = status_code
        self.type = type or ERROR_TYPES.get(status_code, "internal_error")
        self.param = None if param is None else _encodable(param)
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        """The JSON body ``{"error": {...}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> JSONResponse:
        """The body as a FastAPI response with this error's status."""
        return JSONResponse(self.to_dict(), status_code=self.status_code, headers=self.headers)


def error_response(
    message: str,
    status_code: int = 400,
    type: str | None = None,
    param: str | None = None,
    code: str | int | None = None,
) -> JSONResponse:
    """An OpenAI error body as a ``JSONResponse``."""
    return OpenAIError(message, status_code, type, param, code).to_response()


def error_from_validation(exc: ValidationError | RequestValidationError) -> OpenAIError:
    """A 400 naming the first invalid field (``param`` is its dotted path, without ``body``)."""
    errors = exc.errors()
    if not errors:
        return OpenAIError(str(exc))
    err = errors[0]
    loc = [str(part) for part in err.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    if err.get("type") == "json_invalid":
        return OpenAIError(f"Invalid JSON body: {err.get('msg', '')}")
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if "type" in err:
        # pydantic's own line (vLLM relays it): clients match on the error type
        # (``greater_than_equal``, ``less_than_equal``, ``int_parsing``, ...)
        value = repr(err.get("input"))
        value = value if len(value) <= 60 else value[:40] + "..." + value[-10:]
        msg += (f" [type={err['type']}, input_value={value}, "
                f"input_type={type(err.get('input')).__name__}]")
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return OpenAIError(f"{param}: {msg}" if param else msg, param=param)


_FIELD_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*)=")


def error_from_value_error(exc: ValueError) -> OpenAIError:
    """A 400 from a ``ValueError`` such as SamplingParams' ``"top_p=2.0 must be in (0, 1]"``.

    The field named before ``=`` becomes ``param``.
    """
    if isinstance(exc, ValidationError):
        return error_from_validation(exc)
    message = str(exc)
    m = _FIELD_PREFIX.match(message)
    return OpenAIError(message, param=m.group(1) if m else None)


def add_exception_handlers(app: FastAPI) -> None:
    """Make ``app`` answer with OpenAI error bodies.

    OpenAIError -> its status; request/pydantic validation errors -> 400 naming the field;
    Starlette's own HTTP errors (404 unknown route, 405 wrong method) -> their status and
    headers (``Allow``) with an OpenAI body; any other exception -> 500 ``internal_error``. A ``ValueError`` from ``to_sampling_params`` is not
    caught globally (a bug elsewhere must not look like a bad request): convert it where it is
    raised with ``error_from_value_error``.
    """

    async def on_openai_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return exc.to_response()

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, (ValidationError, RequestValidationError))
        return error_from_validation(exc).to_response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        # clients of an OpenAI API parse ``error.message``; FastAPI's ``{"detail": ...}`` would
        # leave them with no message at all
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"Not found: {where} (no such route)"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("allow") or (exc.headers or {}).get("Allow")
            message = f"Method not allowed: {where}" + (f" (allowed: {allowed})" if allowed
                                                        else "")
        else:
            message = f"{exc.detail}: {where}"
        resp = error_response(message, exc.status_code)
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    async def on_internal_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500)

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_internal_error)
