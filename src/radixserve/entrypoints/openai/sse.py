"""Server-sent events framing of streamed responses."""

from __future__ import annotations

from typing import Any

import msgspec

_json = msgspec.json.Encoder()

#: The last event of every stream (OpenAI's terminator).
SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return b"data: " + _json.encode(obj) + b"\n\n"
