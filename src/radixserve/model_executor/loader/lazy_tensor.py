"""Checkpoint tensors read on demand, a block of rows at a time.

The loader hands the model ``(name, LazyTensor)`` pairs instead of tensors, so that a weight goes
from the file into its parameter (final dtype, device and shard) without the whole tensor, let
alone the whole model, ever sitting in memory in another dtype: a 7B model in bfloat16 loads in
its own 15 GB plus a bounded buffer (``CHUNK_BYTES``), not in 30 GB of float32.

Two kinds: :class:`SafetensorsTensor` (a tensor of a ``*.safetensors`` file, sliced through
``safetensors``' own lazy reader) and ``gguf_weights.GgufTensor`` (a GGUF tensor, dequantized a
block of rows at a time).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

#: the most bytes of source rows (at float32 width) read in one go while copying a tensor into
#: its parameter: bounds the loader's transient memory on top of the model's own
CHUNK_BYTES = 128 << 20


class StagingBuffer:
    """One reusable uint8 buffer for stored bytes that the caller consumes at once (a GGUF's
    block rows, read and then packed into their serving layout). Fresh memory costs a page
    fault per 4 KiB on first touch, more than the copy: a 76 MB ``preadv`` from the page cache
    ran at 1.2-1.8 GB/s into new memory and at 8-9.7 GB/s into memory already touched (Zen 5
    VM), so a loader reads every such tensor into this one buffer, grown to the largest."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        """Bytes the buffer holds now (0 before the first ``get``)."""
        return 0 if self._buf is None else self._buf.numel()

    def get(self, nbytes: int) -> torch.Tensor:
        """A contiguous uint8 [nbytes] view of the buffer (its contents are the last user's);
        valid until the next ``get``."""
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None  # the old one goes before the larger one is made
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes]


class LazyTensor(ABC):
    """A 1-D or 2-D checkpoint tensor that is read only when asked.

    Attributes:
        name: its name in the checkpoint (Hugging Face naming, e.g.
            ``model.layers.0.self_attn.q_proj.weight``).
        shape: its shape in torch order (``[out_features, in_features]`` for a linear weight).
    """

    name: str
    shape: tuple[int, ...]

    @abstractmethod
    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` (dim 0) as a CPU tensor of the file's value type (float32 for
        dequantized blocks), contiguous, owned by the caller.

        Raises:
            ValueError: the bytes cannot be read or decoded (the message names the tensor).
        """

    def describe(self) -> str:
        """Where the tensor comes from, for error messages."""
        return self.name

    def full(self) -> torch.Tensor:
        """The whole tensor (``rows(0, shape[0])``)."""
        return self.rows(0, self.shape[0])

    def row_chunk(self) -> int:
        """How many rows one read may take so it stays under ``CHUNK_BYTES`` at float32."""
        per_row = 4 * (self.shape[1] if len(self.shape) > 1 else 1)
        return max(1, CHUNK_BYTES // per_row)


class SafetensorsTensor(LazyTensor):
    """One tensor of a safetensors file, read through ``safetensors.safe_open``'s slices.

    The file is opened for each read and closed after it, so its memory map never holds more
    than the rows being read: a map kept open for the whole load would leave every page read so
    far resident, doubling the load's peak memory.
    """

    def __init__(self, file: Path, name: str, shape: tuple[int, ...]) -> None:
        self.file, self.name, self.shape = file, name, tuple(shape)

    def describe(self) -> str:
        return f"{self.name} in {self.file.name}"

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.file), framework="pt", device="cpu") as f:
                part = f.get_slice(self.name)[lo:hi]
        except SafetensorError as e:
            raise ValueError(f"{self.file}: cannot read tensor {self.name!r}: {e}") from e
        return part.contiguous()


class TensorRows(LazyTensor):
    """An in-memory tensor behind the same interface (tests, and callers that already hold
    their weights)."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        self.name, self.tensor, self.shape = name, tensor, tuple(tensor.shape)

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        return self.tensor[lo:hi]


def as_lazy(name: str, w: LazyTensor | torch.Tensor) -> LazyTensor:
    """``w`` itself, or a tensor wrapped as :class:`TensorRows`."""
    return w if isinstance(w, LazyTensor) else TensorRows(name, w)


def copy_rows(dst: torch.Tensor, src: LazyTensor, rows: tuple[int, int],
              cols: tuple[int, int] | None = None) -> None:
    """``dst[:n] = src[rows[0]:rows[1], cols[0]:cols[1]]`` (n = the row count; all columns
    when ``cols`` is None), read and converted to ``dst``'s dtype and device a ``CHUNK_BYTES``
    block of rows at a time.

    Raises:
        ValueError: from ``src.rows`` (unreadable bytes).
    """
    n = rows[1] - rows[0]
    step = src.row_chunk()
    for s in range(0, n, step):
        e = min(n, s + step)
        part = src.rows(rows[0] + s, rows[0] + e)
        if cols is not None:
            part = part[:, cols[0]:cols[1]]
        dst[s:e].copy_(part)
