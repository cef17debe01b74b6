"""A small deterministic numpy quantizer for ggml's K-quants (Q4_K, Q5_K, Q6_K), which gguf-py
can dequantize but not quantize, and llama.cpp's Q4_K_M / Q5_K_M choice of type per tensor, so
the suite can rebuild K-quant files of the default model without llama.cpp.

Block layouts are ggml's (``ggml-common.h``: ``block_q4_K``, ``block_q5_K``, ``block_q6_K``;
QK_K = 256 values per super-block):

* Q4_K, 144 bytes: fp16 ``d``, fp16 ``dmin``, ``scales[12]`` (eight 6-bit scales and eight 6-bit
  mins, packed as ``get_scale_min_k4`` reads them), ``qs[128]`` (4-bit values: byte ``32 j + l``
  holds value ``l`` of sub-block ``2 j`` in its low nibble, of ``2 j + 1`` in its high one);
  value = ``d * sc[s] * q - dmin * m[s]`` for the 32-value sub-block ``s``.
* Q5_K, 176 bytes: as Q4_K with ``qh[32]`` between ``scales`` and ``qs``: bit ``s`` of
  ``qh[l]`` is the fifth bit of value ``l`` of sub-block ``s``.
* Q6_K, 210 bytes: ``ql[128]`` (low 4 bits), ``qh[64]`` (high 2 bits), ``scales[16]`` (int8),
  fp16 ``d``; value = ``d * scales[s] * (q - 32)`` for the 16-value sub-block ``s``. Each half
  of 128 values uses 64 ``ql`` and 32 ``qh`` bytes: its quarters 0..3 (32 values each) are the
  low nibbles of ``ql[l]``, ``ql[l + 32]``, then their high nibbles, and bits ``2 i, 2 i + 1``
  of ``qh[l]``.

The search is not llama.cpp's (no importance weights, no iterative refinement): Q4_K/Q5_K take
each sub-block's min (at most 0) and max, Q6_K each sub-block's absmax; the super-block scales
are the largest sub-block scale / 63 (127 for Q6_K) rounded to fp16, and each sub-block's
6-bit (8-bit) scale is rounded against that stored fp16 value. Every step is elementwise or a
min/max in float32 with ``np.rint`` (round half to even), so the bytes are the same on every
machine and run.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}

# llama.cpp's fallback (llama-quant.cpp) for a tensor whose rows are not whole super-blocks
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# the llama_ftype values a file of each mix names in general.file_type
MIX_FILE_TYPE = {"Q4_K_M": 15, "Q5_K_M": 17}
_MIX_BASE = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 bytes as uint8 [..., 2], the fp16 value as float32)."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(*x.shape, 2), h.astype(np.float32)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den in float32, 0 where den is 0."""
    out = np.zeros(np.broadcast(num, den).shape, dtype=np.float32)
    np.divide(num, den, out=out, where=np.broadcast_to(den > 0, out.shape))
    return out


def _quantize_q4_q5_k(x: np.ndarray, bits: int) -> np.ndarray:
    """float32 [nb, 256] -> uint8 [nb, 144] (bits=4, Q4_K) or [nb, 176] (bits=5, Q5_K)."""
    nb = x.shape[0]
    nmax = np.float32((1 << bits) - 1)
    xb = x.reshape(nb, 8, 32)
    # the stored min is subtracted and unsigned, so the range always reaches 0
    mn = np.minimum(xb.min(-1), np.float32(0))
    scale = (xb.max(-1) - mn) / nmax
    d_bytes, d = _f16(scale.max(-1) / np.float32(63))
    dmin_bytes, dmin = _f16((-mn).max(-1) / np.float32(63))
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_ratio(-mn, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc.astype(np.float32)
    offset = dmin[:, None] * m.astype(np.float32)
    q = np.clip(np.rint(_ratio(xb + offset[..., None], step[..., None])), 0, nmax)
    q = q.astype(np.uint8)

    scales = np.empty((nb, 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    pairs = (q & 0x0F).reshape(nb, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(nb, 128)
    parts = [d_bytes, dmin_bytes, scales]
    if bits == 5:
        high = (q >> 4).astype(np.uint8)  # [nb, 8, 32]: bit s of qh[l] is sub-block s's
        qh = np.zeros((nb, 32), dtype=np.uint8)
        for s in range(8):
            qh |= high[:, s] << s
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [nb, 256] -> uint8 [nb, 210] (Q6_K)."""
    nb = x.shape[0]
    xb = x.reshape(nb, 16, 16)
    scale = np.abs(xb).max(-1) / np.float32(31)
    d_bytes, d = _f16(scale.max(-1) / np.float32(127))
    sc = np.clip(np.rint(_ratio(scale, d[:, None])), 0, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = np.clip(np.rint(_ratio(xb, step[..., None])), -32, 31) + 32
    quarters = q.astype(np.uint8).reshape(nb, 2, 4, 32)  # [block, half, quarter, l]
    low, high = quarters & 0x0F, quarters >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4),
                         low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)  # [nb, 2, 64]
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8),
                           d_bytes], axis=1)


def quantize_k(rows: np.ndarray, qtype_name: str) -> np.ndarray:
    """float [N, K] rows (K a multiple of 256) -> uint8 [N, K / 256 * block bytes] of
    ``qtype_name`` (``Q4_K``, ``Q5_K`` or ``Q6_K``) blocks, ggml's layout."""
    if qtype_name not in BLOCK_BYTES:
        raise ValueError(f"not a K-quant: {qtype_name}")
    n, k = rows.shape
    if k % QK_K:
        raise ValueError(f"{qtype_name} needs rows of whole {QK_K}-value super-blocks, got {k}")
    blocks = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, QK_K)
    if qtype_name == "Q6_K":
        out = _quantize_q6_k(blocks)
    else:
        out = _quantize_q4_q5_k(blocks, 4 if qtype_name == "Q4_K" else 5)
    return out.reshape(n, k // QK_K * BLOCK_BYTES[qtype_name])


def quantize(rows: np.ndarray, qtype_name: str) -> np.ndarray:
    """``rows`` float [N, K] as ``qtype_name`` blocks: the K-quants here, the rest by gguf-py."""
    if qtype_name in BLOCK_BYTES:
        return quantize_k(rows, qtype_name)
    import gguf

    return gguf.quants.quantize(rows, gguf.GGMLQuantizationType[qtype_name])


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers and every third
    one between them get the larger type."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def mix_type(mix: str, name: str, columns: int, n_layers: int, tied_output: bool) -> str:
    """The ggml type name llama.cpp's ``llama_tensor_get_type`` gives the 2-D tensor ``name``
    (``columns`` values per row) of a Llama-family model in the file type ``mix``
    (``Q4_K_M`` or ``Q5_K_M``): the output (or a tied token embedding) in Q6_K, ``attn_v``
    and ``ffn_down`` in Q6_K in the ``use_more_bits`` layers, everything else in the base
    K-quant; a tensor whose rows are not whole super-blocks falls back as llama.cpp does
    (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0). Only the rules a dense Llama reaches."""
    qtype = _MIX_BASE[mix]
    part = name.split(".")
    if name == "output.weight" or (name == "token_embd.weight" and tied_output) or (part[0] == "blk" and part[2] in ("attn_v", "ffn_down")
          and _use_more_bits(int(part[1]), n_layers)):
        qtype = "Q6_K"
    if columns % QK_K:
        qtype = FALLBACK[qtype]
    return qtype
