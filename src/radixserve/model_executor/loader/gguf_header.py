"""A GGUF file's header: its architecture and tensor table, read without importing transformers.

The engine core needs only where each tensor lives to read the weights (``gguf_weights``);
transformers' header reader costs a ~1 s import of transformers in every engine process and
gguf-py's ``GGUFReader`` seconds (it builds an array per vocabulary entry). The layout follows
the GGUF specification (ggml's ``docs/gguf.md``): a ``b"GGUF"`` magic, ``u32`` version,
``u64`` tensor count, ``u64`` metadata count; metadata as (string key, ``u32`` type, value);
then per tensor its string name, ``u32`` dimension count, ``u64`` dimensions (fastest-moving
first), ``u32`` ggml type and ``u64`` offset from the data section, which starts at the next
multiple of ``general.alignment`` (default 32). Strings are a ``u64`` byte length and UTF-8
bytes; every number is little-endian. Versions 2 and 3 (version 1 counted in ``u32``; no file
in use still has it).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

GGUF_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
#: metadata value types of a fixed width: type id -> struct format (8 = string, 9 = array)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GgufHeader(NamedTuple):
    """What a GGUF file says before its tensor data.

    Attributes:
        version: the GGUF version (2 or 3).
        metadata: every metadata key with its value; string arrays (a vocabulary, a merge
            table) are given as their length only, number arrays as lists.
        tensors: ``(name, shape, ggml_type, offset)`` per tensor in file order: ``shape`` in
            torch order (slowest-moving first, the ggml dimensions reversed), ``offset`` in
            bytes from ``data_start``.
        data_start: absolute byte offset of the tensor data section.
    """

    version: int
    metadata: dict[str, Any]
    tensors: list[tuple[str, tuple[int, ...], int, int]]
    data_start: int


class _Cursor:
    """Reads little-endian fields from a buffer, advancing ``pos``."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def value(self, kind: int) -> Any:
        if kind in _SCALAR:
            return self.unpack(_SCALAR[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"metadata value of unknown type {kind}")
        elem, count = self.unpack("<IQ")
        if elem in _SCALAR:
            return list(self.unpack(f"<{count}{_SCALAR[elem][1]}"))
        if elem != _STRING:
            raise ValueError(f"metadata array of element type {elem}")
        for _ in range(count):  # strings of their own lengths: only walked, not decoded
            (n,) = self.unpack("<Q")
            self.pos += n
        return count


def read_gguf_header(path: Path) -> GgufHeader:
    """Parse ``path``'s header and tensor table; no tensor data is read.

    Raises:
        ValueError: not a GGUF file, an unsupported version, no ``general.architecture``, or
            a header that is truncated or corrupt (the message names the file and the cause).
        OSError: the file cannot be opened.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} does not start with the GGUF magic bytes")
        c = _Cursor(buf)
        c.pos = 4
        try:
            version, n_tensors, n_meta = c.unpack("<IQQ")
            if version not in _VERSIONS:
                raise ValueError(f"GGUF version {version} (radixserve reads versions 2 and 3)")
            meta: dict[str, Any] = {}
            for _ in range(n_meta):
                key = c.string()
                (kind,) = c.unpack("<I")
                meta[key] = c.value(kind)
            tensors = []
            for _ in range(n_tensors):
                name = c.string()
                (n_dims,) = c.unpack("<I")
                dims = c.unpack(f"<{n_dims}Q")
                ggml_type, offset = c.unpack("<IQ")
                tensors.append((name, tuple(reversed(dims)), ggml_type, offset))
        except (struct.error, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"{path}: cannot read the GGUF header (truncated or corrupt "
                             f"file?): {type(e).__name__}: {e}") from e
        if "general.architecture" not in meta:
            raise ValueError(f"{path} has no general.architecture in its GGUF metadata")
        align = int(meta.get("general.alignment", 32))
        data_start = (c.pos + align - 1) // align * align
    return GgufHeader(version, meta, tensors, data_start)
