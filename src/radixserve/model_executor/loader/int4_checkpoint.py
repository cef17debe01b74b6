"""AWQ and GPTQ 4-bit safetensors checkpoints, read as ggml blocks the quantized kernels serve.

Both formats hold each linear as 4-bit integers ``q`` with, per output channel and group of
``group_size`` inputs, a float16 ``scale`` and a 4-bit ``zero``: ``w = (q - zero) * scale``.
A group is a whole number of ggml's 32-value blocks (group sizes 32, 64, 128, or -1: all of
K), so each block of 32 inputs of an output row has one scale and one zero and maps exactly
onto ggml's Q4_1 (``d * q + m`` with ``d = scale``, ``m = -zero * scale`` rounded to float16,
at most half a float16 step of ``m`` off: ~0.3% of one quantization step) or, where every zero
is 8 (symmetric GPTQ), onto Q4_0 (``d * (q - 8)``, exact). The tensors are re-packed at load, a
bounded number of output rows at a time; the projections are then served by the same kernels
and fused decode stack as a GGUF's (``layers.quantized``).

Layouts (vLLM's AWQ and GPTQ kernels read the same ones):
  * AWQ (``quant_method: awq``, ``version: gemm``): ``qweight`` int32 ``[K, N / 8]``, output
    ``8 j + i`` of input k in bits ``4 * AWQ_SHIFT[i]`` of ``qweight[k, j]`` with ``AWQ_SHIFT =
    [0, 4, 1, 5, 2, 6, 3, 7]``; ``qzeros`` int32 ``[K / G, N / 8]`` packed the same way;
    ``scales`` float16 ``[K / G, N]``.
  * GPTQ (``quant_method: gptq``): ``qweight`` int32 ``[K / 8, N]``, input ``8 r + i`` in bits
    ``4 i`` of ``qweight[r, n]``; ``qzeros`` int32 ``[K / G, N / 8]``, output ``8 j + i`` in
    bits ``4 i``, stored minus one in the original format (``checkpoint_format: gptq``; not in
    ``gptq_v2``); ``scales`` float16 ``[K / G, N]``; ``g_idx`` int32 ``[K]``, which must be
    ``k // G`` (``desc_act: false``; an act-order permutation is refused).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .lazy_tensor import LazyTensor, SafetensorsTensor, StagingBuffer

#: ggml type ids of the blocks made here (``gguf.GGMLQuantizationType``)
Q4_0, Q4_1 = 2, 3
#: AWQ's nibble order: output ``8 j + i`` sits in nibble ``AWQ_SHIFT[i]`` of its int32
AWQ_SHIFT = (0, 4, 1, 5, 2, 6, 3, 7)
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class Int4Scheme:
    """A checkpoint's 4-bit scheme, from config.json's ``quantization_config``.

    Attributes:
        method: "awq" or "gptq".
        group_size: inputs per scale and zero (-1: all of K).
        zeros_minus_one: GPTQ's original format stores each zero minus one.
    """

    method: str
    group_size: int
    zeros_minus_one: bool

    @classmethod
    def from_config(cls, quant: dict) -> Int4Scheme:
        """Parse ``quantization_config``.

        Raises:
            ValueError: naming the field: another ``quant_method``, ``bits`` other than 4, a
                ``group_size`` that is not -1 or a multiple of 32, AWQ's ``gemv`` packing or
                no zero point, GPTQ with ``desc_act``.
        """
        method = str(quant.get("quant_method", "")).lower()
        if method not in ("awq", "gptq"):
            raise ValueError(f"config.json: quantization_config with quant_method={method!r} "
                             "is not supported: radixserve serves unquantized safetensors, AWQ "
                             "and GPTQ 4-bit checkpoints and GGUF files")
        bits = quant.get("bits", quant.get("w_bit"))
        if bits != 4:
            raise ValueError(f"config.json: quantization_config.bits={bits!r} is not supported "
                             f"for {method} (4 only)")
        group = quant.get("group_size", quant.get("q_group_size"))
        if not isinstance(group, int) or not (group == -1 or (group > 0 and group % 32 == 0)):
            raise ValueError(f"config.json: quantization_config.group_size={group!r} is not "
                             "supported (-1 or a multiple of 32: ggml's blocks)")
        if method == "awq":
            version = str(quant.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"config.json: quantization_config.version={version!r} is "
                                 "not supported for awq (gemm packing only)")
            if quant.get("zero_point", True) is False:
                raise ValueError("config.json: quantization_config.zero_point=false is not "
                                 "supported for awq")
            return cls("awq", group, False)
        if quant.get("desc_act"):
            raise ValueError("config.json: quantization_config.desc_act=true is not supported "
                             "for gptq (act-order permutes the groups)")
        fmt = str(quant.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"config.json: quantization_config.checkpoint_format={fmt!r} is "
                             "not supported for gptq")
        return cls("gptq", group, fmt == "gptq")


def _unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] (AWQ's order) -> int64 [R, 8 C] nibbles."""
    shifts = torch.tensor([4 * s for s in AWQ_SHIFT], dtype=torch.int64)
    return ((packed.to(torch.int64)[:, :, None] >> shifts) & 15).reshape(packed.shape[0], -1)


def _unpack_seq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int64 [R, 8 C] nibbles, nibble i of each int32 at 8 c + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    return ((packed.to(torch.int64)[:, :, None] >> shifts) & 15).reshape(packed.shape[0], -1)


class Int4Tensor(LazyTensor):
    """One AWQ/GPTQ linear under its Hugging Face ``.weight`` name, shape ``[N, K]``: rows
    (output features) dequantized to float32, or re-packed as ggml blocks (``block_rows``).

    Args:
        scheme: the checkpoint's scheme.
        name: the weight's name (``...q_proj.weight``).
        parts: its ``qweight``, ``qzeros``, ``scales`` (and GPTQ's ``g_idx``) tensors.

    Raises:
        ValueError: a missing part, or shapes that do not fit one another or the scheme
            (naming the tensor).
    """

    def __init__(self, scheme: Int4Scheme, name: str, parts: dict[str, LazyTensor]) -> None:
        prefix = name.removesuffix(".weight")
        missing = [p for p in _PARTS[:3] if p not in parts]
        if missing:
            raise ValueError(f"{scheme.method} checkpoint: {prefix} lacks "
                             f"{', '.join(prefix + '.' + p for p in missing)}")
        self.scheme, self.name, self.parts = scheme, name, parts
        qw, sc = parts["qweight"].shape, parts["scales"].shape
        if scheme.method == "awq":
            k, n = qw[0], qw[1] * 8
        else:
            k, n = qw[0] * 8, qw[1]
        group = k if scheme.group_size == -1 else scheme.group_size
        if k % group or tuple(sc) != (k // group, n) or k % 32:
            raise ValueError(f"{scheme.method} checkpoint: {prefix}: qweight {tuple(qw)} and "
                             f"scales {tuple(sc)} do not fit group_size {scheme.group_size}")
        if tuple(parts["qzeros"].shape) != (k // group, n // 8):
            raise ValueError(f"{scheme.method} checkpoint: {prefix}.qzeros has shape "
                             f"{tuple(parts['qzeros'].shape)}, expected {(k // group, n // 8)}")
        self.shape = (n, k)
        self.group = group
        self._zeros8: bool | None = None

    def describe(self) -> str:
        return f"{self.name.removesuffix('.weight')} ({self.scheme.method} int4)"

    @property
    def quantized(self) -> bool:
        return True

    @property
    def ggml_type(self) -> int:
        """Q4_0 where every zero is 8 (symmetric), else Q4_1."""
        if self._zeros8 is None:
            z, _ = self._zeros_scales(0, self.shape[0])
            self._zeros8 = bool((z == 8).all())
        return Q4_0 if self._zeros8 else Q4_1

    def _cols(self, part: str, lo: int, hi: int) -> torch.Tensor:
        """Columns ``lo:hi`` of a 2-D part (all rows), read from its file."""
        src = self.parts[part]
        if not isinstance(src, SafetensorsTensor):
            return src.full()[:, lo:hi]
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(src.file), framework="pt", device="cpu") as f:
                return f.get_slice(src.name)[:, lo:hi].contiguous()
        except SafetensorError as e:
            raise ValueError(f"{src.file}: cannot read tensor {src.name!r}: {e}") from e

    def _zeros_scales(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 zeros and float32 scales of outputs ``lo:hi``, both ``[hi - lo, K / G]``."""
        a, b = lo // 8, -(-hi // 8)
        packed = self._cols("qzeros", a, b)
        z = (_unpack_awq if self.scheme.method == "awq" else _unpack_seq)(packed)
        z = z[:, lo - 8 * a:hi - 8 * a]
        if self.scheme.zeros_minus_one:
            z = z + 1
        s = self._cols("scales", lo, hi).float()
        return z.T.contiguous(), s.T.contiguous()

    def _q(self, lo: int, hi: int) -> torch.Tensor:
        """int64 [hi - lo, K] 4-bit values of outputs ``lo:hi``."""
        if self.scheme.method == "awq":
            a, b = lo // 8, -(-hi // 8)
            q = _unpack_awq(self._cols("qweight", a, b))[:, lo - 8 * a:hi - 8 * a]
            return q.T.contiguous()
        packed = self._cols("qweight", lo, hi)  # [K / 8, hi - lo]
        shifts = torch.arange(0, 32, 4, dtype=torch.int64)
        q = (packed.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & 15
        return q.reshape(self.shape[1], hi - lo).T.contiguous()

    def _check_g_idx(self) -> None:
        g_idx = self.parts.get("g_idx")
        if g_idx is None:
            return
        want = torch.arange(self.shape[1]) // self.group
        if not torch.equal(g_idx.full().to(torch.int64), want):
            raise ValueError(f"{self.describe()}: g_idx is not k // group_size (act-order "
                             "checkpoints are not supported)")

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Outputs ``lo:hi`` as float32 ``[hi - lo, K]``: ``(q - zero) * scale``."""
        self._check_g_idx()
        z, s = self._zeros_scales(lo, hi)
        q = self._q(lo, hi).reshape(hi - lo, -1, self.group)
        return ((q - z[:, :, None]).float() * s[:, :, None]).reshape(hi - lo, -1)

    def block_rows(self, lo: int, hi: int, stage: StagingBuffer | None = None) -> torch.Tensor:
        """Outputs ``lo:hi`` as ggml blocks, uint8 ``[hi - lo, K / 32 * (18 or 20)]``
        (``ggml_type``: Q4_0 18 bytes, Q4_1 20 bytes per 32 values). ``stage`` is not used:
        the blocks are computed, not read."""
        self._check_g_idx()
        n, k = hi - lo, self.shape[1]
        z, s = self._zeros_scales(lo, hi)
        per_block = self.group // 32
        z = z.repeat_interleave(per_block, dim=1)  # [n, K / 32]
        s = s.repeat_interleave(per_block, dim=1)
        q = self._q(lo, hi).reshape(n, k // 32, 2, 16).to(torch.uint8)
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).numpy()  # value i low, i + 16 high nibble
        d = s.numpy().astype(np.float16).view(np.uint8).reshape(n, k // 32, 2)
        if self.ggml_type == Q4_0:
            return torch.from_numpy(np.concatenate([d, qs], axis=2).reshape(n, -1))
        m = (-(z.float() * s)).numpy().astype(np.float16).view(np.uint8).reshape(n, k // 32, 2)
        return torch.from_numpy(np.concatenate([d, m, qs], axis=2).reshape(n, -1))

    def row_chunk(self) -> int:
        return max(8, super().row_chunk() // 8 * 8)


def int4_weights(weights: Iterable[tuple[str, LazyTensor]], scheme: Int4Scheme
                 ) -> Iterator[tuple[str, LazyTensor]]:
    """The checkpoint's ``(name, LazyTensor)`` pairs with each linear's ``qweight``,
    ``qzeros``, ``scales`` (and ``g_idx``) joined into one :class:`Int4Tensor` named
    ``...weight``; every other tensor as it comes.

    Raises:
        ValueError: a linear missing one of its parts, or parts that do not fit.
    """
    groups: dict[str, dict[str, LazyTensor]] = {}
    for name, t in weights:
        prefix, _, part = name.rpartition(".")
        if part in _PARTS:
            groups.setdefault(prefix, {})[part] = t
        else:
            yield name, t
    for prefix, parts in groups.items():
        yield prefix + ".weight", Int4Tensor(scheme, prefix + ".weight", parts)


def folder_scheme(folder: Path | None, config: object) -> Int4Scheme | None:
    """The 4-bit scheme of a safetensors folder's ``quantization_config``, None without one.

    Raises:
        ValueError: from ``Int4Scheme.from_config``.
    """
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    return Int4Scheme.from_config(quant)
