"""Log formatting for every radixserve process: ``configure_logging(level, fmt)`` with
``fmt`` "text" (one human-readable line per record) or "json" (one JSON object per line, for
log collectors). Structured fields a record carries in ``extra={"fields": {...}}`` (the
per-request and stats lines, ``entrypoints/request_log.py``) become top-level keys of the
JSON object; the text line shows them in its message.

A leaf module (stdlib only): the engine-core process, which imports no server layer, formats
its records the same way (``LOG_FORMAT_ENV`` carries the choice to it).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

#: The log formats ``--log-format`` accepts.
LOG_FORMATS = ("text", "json")
#: Environment variable that carries ``--log-format`` into child processes (the engine core).
LOG_FORMAT_ENV = "RADIXSERVE_LOG_FORMAT"
#: The text format's line layout.
TEXT_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (ISO 8601, UTC, milliseconds), ``level``,
    ``logger``, ``message``, the record's ``fields`` as top-level keys, and ``exc_info`` when
    an exception is attached. Values JSON cannot encode are written as ``str(value)``."""

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        obj: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for k, v in fields.items():
                obj.setdefault(k, v)
        if record.exc_info:
            obj["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str, ensure_ascii=False)


def configure_logging(level: str | int = "info", fmt: str | None = None) -> None:
    """Set the root logger's level and its one handler (stderr) to ``fmt``, replacing any
    handler set before; exports the format in ``LOG_FORMAT_ENV`` so child processes started
    later format alike.

    Args:
        level: a logging level name ("info", "DEBUG", ...) or number.
        fmt: "text" or "json"; None takes ``LOG_FORMAT_ENV`` (default "text").

    Raises:
        ValueError: ``fmt`` is not one of ``LOG_FORMATS``.
    """
    fmt = fmt or os.environ.get(LOG_FORMAT_ENV) or "text"
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log_format={fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    os.environ[LOG_FORMAT_ENV] = fmt
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
