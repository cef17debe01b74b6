"""Where radixserve keeps files it builds once per machine (converted GGUF models, compiled
CPU kernels)."""

from __future__ import annotations

import os
from pathlib import Path

#: overrides the whole cache root
CACHE_ENV = "RADIXSERVE_CACHE_DIR"


def cache_dir(sub: str) -> Path:
    """``$RADIXSERVE_CACHE_DIR/<sub>`` when that variable is set, else
    ``$XDG_CACHE_HOME/radixserve/<sub>`` (``~/.cache/radixserve/<sub>`` by default)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser() / sub
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "radixserve" / sub
