"""A GGUF file's weights, read straight from the file under their Hugging Face names.

No converted copy is written or held: each tensor is read with ``os.pread`` a block of rows at a
time and dequantized by gguf-py (``gguf.quants.dequantize``, llama.cpp's reference formulas in
numpy) into float32 rows that the model copies into its parameters in the serving dtype
(``lazy_tensor.copy_rows``). ``os.pread`` rather than a memory map: a map's pages stay resident
while it is open, so reading a whole file through one would add the file's size to the load's
peak memory.

Names follow llama.cpp's (``gguf.constants.TENSOR_NAMES``) for the dense decoders radixserve
serves (llama, mistral, qwen2, qwen3). llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of
``q_proj`` and ``k_proj`` of ``llama``-architecture files (``LlamaModel.permute``) so that its
RoPE can rotate adjacent pairs; :class:`GgufTensor` undoes it, as transformers'
``LlamaTensorProcessor`` does.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .gguf_header import read_gguf_header
from .lazy_tensor import LazyTensor, StagingBuffer

#: ggml type ids stored as plain values (not quantized blocks) and their torch dtypes
_PLAIN = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}

#: llama.cpp tensor names -> Hugging Face names (``{i}``: the layer), for dense decoders
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
#: tensors the config already carries (llama3 RoPE factors, see ``gguf_loader``)
_SKIPPED = {"rope_freqs.weight"}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class GgufTensorInfo:
    """Where one tensor lives in a GGUF file.

    Attributes:
        name: llama.cpp's name (``blk.0.attn_q.weight``).
        shape: torch order (``[rows, row elements]``).
        ggml_type: ggml type id (``gguf.GGMLQuantizationType``).
        offset: absolute byte offset of its data in the file.
        nbytes: bytes of its data.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


def type_name(ggml_type: int) -> str:
    """``Q4_K`` for 12, or ``type 99`` for an id gguf-py does not know."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def read_tensor_table(path: Path) -> tuple[str, list[GgufTensorInfo]]:
    """The file's ``general.architecture`` and tensor table, checked against the file size.

    Uses radixserve's own header reader (``gguf_header``: milliseconds, and no transformers
    import in the engine process).

    Raises:
        ValueError: unreadable metadata, a ggml type radixserve cannot read (naming it and the
            tensor), or a tensor whose data runs past the end of the file (truncated file).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    infos: list[GgufTensorInfo] = []
    header = read_gguf_header(path)
    arch, data_start = str(header.metadata["general.architecture"]), header.data_start
    for name, shape, ggml_type, rel in header.tensors:
        n = 1
        for d in shape:
            n *= d
        if ggml_type in _PLAIN:
            nbytes = n * _PLAIN[ggml_type].itemsize
        else:
            try:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError):
                raise ValueError(f"{path}: tensor {name!r} has ggml type {ggml_type}, which "
                                 "radixserve cannot read") from None
            if shape[-1] % block:
                raise ValueError(f"{path}: tensor {name!r} ({type_name(ggml_type)}) has rows "
                                 f"of {shape[-1]} values, not a multiple of its block of "
                                 f"{block}")
            nbytes = n // block * block_bytes
        info = GgufTensorInfo(name, tuple(shape), ggml_type, data_start + rel, nbytes)
        if info.offset + nbytes > size:
            raise ValueError(f"{path}: tensor {name!r} ({type_name(ggml_type)}, shape "
                             f"{list(shape)}) ends at byte {info.offset + nbytes} but the file "
                             f"has {size} bytes: the file is truncated")
        infos.append(info)
    return arch, infos


class GgufTensor(LazyTensor):
    """One GGUF tensor under its Hugging Face name; rows dequantized to float32 on read.

    Args:
        path: the GGUF file.
        info: the tensor's entry in the file's table.
        name: its Hugging Face name.
        qk_heads: for a llama-architecture ``q_proj``/``k_proj``, the number of heads whose
            rows llama.cpp permuted (the query heads for q, the KV heads for k); else None.
    """

    def __init__(self, path: Path, info: GgufTensorInfo, name: str,
                 qk_heads: int | None = None) -> None:
        self.path, self.info, self.name = path, info, name
        self.shape = info.shape
        self.qk_heads = qk_heads

    def describe(self) -> str:
        """``blk.0.attn_q.weight (Q4_K)``, for error messages."""
        return f"{self.info.name} ({type_name(self.info.ggml_type)})"

    @property
    def ggml_type(self) -> int:
        """The tensor's ggml type id (``gguf.GGMLQuantizationType``)."""
        return self.info.ggml_type

    @property
    def quantized(self) -> bool:
        """Whether its values are stored in quantized blocks (not plain F32/F16/BF16)."""
        return self.info.ggml_type not in _PLAIN

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        return self._unpermuted(lo, hi, self._raw_rows)

    def block_rows(self, lo: int, hi: int, stage: StagingBuffer | None = None) -> torch.Tensor:
        """Rows ``lo:hi`` as stored: uint8 ``[hi - lo, row_bytes]`` of ggml blocks (a 2-D
        tensor only), llama's q/k permutation undone (it moves whole rows, and a quantized
        block never spans two rows). With ``stage``, the bytes are read into its buffer and
        the result may be a view of it, valid until its next use (for a caller that packs
        the rows at once).

        Raises:
            ValueError: a 1-D tensor, or the bytes cannot be read (naming the tensor).
        """
        if len(self.info.shape) != 2:
            raise ValueError(f"{self.describe()} is not a matrix")
        row_bytes = self.info.nbytes // self.info.shape[0]
        return self._unpermuted(lo, hi, lambda a, b: self._read_rows(a, b, row_bytes, stage))

    def _read_rows(self, lo: int, hi: int, row_bytes: int,
                   stage: StagingBuffer | None = None) -> torch.Tensor:
        """The stored bytes of rows ``lo:hi`` read straight into a uint8 ``[hi - lo,
        row_bytes]`` tensor (one copy: ``_bytes`` and a writable buffer made from it were
        two, for every weight of a GGUF served in its blocks), a view of ``stage``'s buffer
        where one is given.

        Raises:
            ValueError: the bytes cannot be read, or the file ends first (naming the tensor).
        """
        out = (torch.empty(hi - lo, row_bytes, dtype=torch.uint8) if stage is None
               else stage.get((hi - lo) * row_bytes).view(hi - lo, row_bytes))
        view = memoryview(out.numpy()).cast("B")
        at, n = 0, view.nbytes
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                while at < n:  # one read returns at most ~2 GiB on Linux
                    got = os.preadv(fd, [view[at:]], self.info.offset + lo * row_bytes + at)
                    if got == 0:
                        break
                    at += got
            finally:
                os.close(fd)
        except OSError as e:
            raise ValueError(f"{self.path}: cannot read tensor {self.describe()}: {e}") from e
        if at != n:
            raise ValueError(f"{self.path}: tensor {self.describe()} is cut short (the file "
                             "is truncated)")
        return out

    def _unpermuted(self, lo: int, hi: int, read) -> torch.Tensor:  # noqa: ANN001
        if self.qk_heads is None:
            return read(lo, hi)
        # un-permute whole heads: head h's rows are a permutation of the same rows in the file
        per_head = self.shape[0] // self.qk_heads
        h0, h1 = lo // per_head, -(-hi // per_head)
        raw = read(h0 * per_head, h1 * per_head)
        w = raw.reshape(h1 - h0, per_head // 2, 2, *raw.shape[1:]).transpose(1, 2)
        w = w.reshape(raw.shape)
        return w[lo - h0 * per_head:hi - h0 * per_head].contiguous()

    def _raw_rows(self, lo: int, hi: int) -> torch.Tensor:
        info = self.info
        if len(info.shape) == 1:  # a vector: read whole (small), then sliced
            return self._read(0, 1, info.nbytes).reshape(-1)[lo:hi].contiguous()
        row_bytes = info.nbytes // info.shape[0]
        return self._read(lo, hi, row_bytes).reshape(hi - lo, info.shape[1])

    def _bytes(self, lo: int, hi: int, row_bytes: int) -> bytes:
        """The stored bytes of rows ``lo:hi`` of ``row_bytes`` each."""
        info = self.info
        n = (hi - lo) * row_bytes
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                buf = os.pread(fd, n, info.offset + lo * row_bytes)
            finally:
                os.close(fd)
        except OSError as e:
            raise ValueError(f"{self.path}: cannot read tensor {self.describe()}: {e}") from e
        if len(buf) != n:
            raise ValueError(f"{self.path}: tensor {self.describe()} is cut short (the file "
                             "is truncated)")
        return buf

    def _read(self, lo: int, hi: int, row_bytes: int) -> torch.Tensor:
        """Rows ``lo:hi`` of ``row_bytes`` each, decoded to a flat tensor."""
        info = self.info
        buf = self._bytes(lo, hi, row_bytes)
        if info.ggml_type in _PLAIN:
            t = torch.frombuffer(bytearray(buf), dtype=_PLAIN[info.ggml_type])
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            blocks = np.frombuffer(buf, dtype=np.uint8).reshape(hi - lo, row_bytes)
            try:
                values = dequantize(blocks, GGMLQuantizationType(info.ggml_type))
            except NotImplementedError as e:
                raise ValueError(f"{self.path}: tensor {self.describe()}: gguf-py cannot "
                                 f"dequantize this type: {e}") from e
            t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        return t.reshape(-1)


def iter_gguf_weights(path: Path, num_heads: int, num_kv_heads: int
                      ) -> Iterator[tuple[str, GgufTensor]]:
    """``(Hugging Face name, GgufTensor)`` for every weight of a dense-decoder GGUF file.

    Args:
        path: the GGUF file.
        num_heads, num_kv_heads: the model's query and KV head counts (for llama-architecture
            files, whose q/k rows llama.cpp permuted).

    Raises:
        ValueError: at call time: a header, type or size problem (``read_tensor_table``), or a
            tensor name radixserve does not know (e.g. a mixture-of-experts tensor), naming it.
    """
    arch, infos = read_tensor_table(Path(path))
    permuted = arch == "llama"
    out: list[tuple[str, GgufTensor]] = []
    for info in infos:
        if info.name in _SKIPPED:
            continue
        if info.name in _TOP_NAMES:
            hf = _TOP_NAMES[info.name]
        else:
            m = _LAYER.match(info.name)
            if m is None or m.group(2) not in _LAYER_NAMES:
                raise ValueError(f"{path}: tensor {info.name!r} ({type_name(info.ggml_type)}) "
                                 f"is not part of a dense {arch} decoder radixserve serves")
            hf = f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
        heads = None
        if permuted and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if hf.endswith("q_proj.weight") else num_kv_heads
        out.append((hf, GgufTensor(Path(path), info, hf, heads)))
    return iter(out)
