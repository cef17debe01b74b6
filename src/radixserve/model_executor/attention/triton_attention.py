"""Paged attention in radixserve's own Triton kernels (``--attention-backend triton``).

Three kernels over the paged KV pool ([num_pages, page_size, Hkv, D] per K and V; a token's
keys are found through its sequence's page table, never gathered into a contiguous copy):

* decode, split over the sequence (flash-decoding: Dao, Haziza, Massa, Sizov, "Flash-Decoding
  for long-context inference", 2023): ``_decode_split_kernel`` runs one program per
  (request, KV head, split); each program attends the GQA group's query heads sharing that KV
  head over one slice of the request's keys with the online softmax (Milakov & Gimelshein,
  "Online normalizer calculation for softmax", 2018) and writes its normalized partial output
  and its log-sum-exp; ``_decode_merge_kernel`` combines a request's splits, weighting each
  partial output by exp(lse_split - lse_total). Splitting keeps a GPU busy when the batch is
  small and the sequences long.
* prefill / extend (the FlashAttention-2 forward, Dao 2023, over pages):
  ``_extend_kernel`` runs one program per (chunk, query head, block of the chunk's queries).
  A chunk's queries are the last ``q_len`` positions of a context of ``ctx`` keys whose K/V,
  the chunk's own included, are already in the pool. The keys every query of the block sees
  (the cached prefix plus the chunk's keys before the block) are a first loop without masks;
  the keys on the block's diagonal are a second loop under the causal mask.

The algorithm follows the published papers above; SGLang's ``triton_ops/decode_attention.py``
and ``extend_attention.py`` (from LightLLM) were read for how flash-decoding maps onto a page
table. Exponentials are base 2 (``exp2``, the scale folded with log2(e)), the usual
FlashAttention-2 choice: one multiply fewer per score and a native instruction on GPUs.

Accumulation is float32 whatever the cache dtype; float32 inputs use IEEE products in
``tl.dot`` (not TF32), so float32 results match torch's SDPA to rounding.

The kernels are plain Triton (masked ``tl.load``/``tl.store``, ``tl.dot``) and run on CUDA;
on CPU tensors they run in Triton's interpreter only (``TRITON_INTERPRET=1`` set before triton
is first imported and while kernels run; tests/conftest.py), which is how the unit tests check
them against the SDPA reference. The interpreter's ``tl.dot`` mishandles bfloat16 (it multiplies
the raw bits, triton-lang/triton#11584): on CPU, test bfloat16 only with that op corrected.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from radixserve.model_executor.attention.paged_attention import (
    AttentionMetadata,
    SdpaPagedAttention,
)

#: log2(e): softmax in base 2 (exp2) with the scale multiplied by it
LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(q, k_ptr, v_ptr, page, in_page, kvh, d, kv_mask, visible, m_i, l_i, acc,
                  qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                  DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """One block of keys in the online softmax (Milakov & Gimelshein 2018), shared by the
    decode and extend kernels: the block's K/V rows read through ``page``/``in_page``
    ([BLOCK_N]; ``kv_mask`` masks the loads), scores of the query rows ``q`` [R, BLOCK_D]
    (``visible`` [R, BLOCK_N] hides keys when ``MASKED``), and the running max ``m_i``, sum
    ``l_i`` [R] and output ``acc`` [R, BLOCK_D] (float32) updated. The caller guarantees each
    row sees at least one key by this block, so the running max is finite (no inf - inf)."""
    k = tl.load(k_ptr + page[:, None] * stride_kp + in_page[:, None] * stride_ks
                + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + page[:, None] * stride_vp + in_page[:, None] * stride_vs
                + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_pt,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (request, KV head, split): the group's query heads over one slice of the keys.

    Writes the slice's softmax-normalized output (float32) and its base-2 log-sum-exp; a slice
    past the end of a short sequence is empty and writes lse = -inf (weight 0 in the merge).
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # slices are whole key blocks, so only a sequence's last block is partly masked
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        page = tl.load(page_table_ptr + b * stride_pt + n // PAGE_SIZE, mask=n_mask, other=0)
        in_page = n % PAGE_SIZE
        # every block holds at least one valid key, so the running max stays finite
        m_i, l_i, acc = _attend_block(
            q, k_ptr, v_ptr, page, in_page, kvh, d, n_mask[:, None] & d_mask[None, :],
            n_mask[None, :], m_i, l_i, acc, qk_scale, stride_kp, stride_ks, stride_kh,
            stride_vp, stride_vs, stride_vh, DOT_PRECISION, True)

    nonempty = end > start
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(mid_o_ptr + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos
             + d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(mid_lse_ptr + b * stride_mlb + heads * stride_mlh + split, lse, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (request, query head): its splits' outputs weighted by their share of the total
    softmax mass, exp2(lse_split - max) / sum over splits."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + b * stride_mlb + h * stride_mlh + s, mask=s_mask,
                  other=float("-inf"))
    # split 0 is never empty (every sequence has a key), so the max is finite
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(mid_o_ptr + b * stride_mob + h * stride_moh + s[:, None] * stride_mos
                + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty),
             mask=d_mask)


@triton.jit
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bounds_ptr, page_table_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bc, stride_pt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (prefill chunk, query head, block of BLOCK_M of the chunk's queries): causal
    attention over the chunk's context, read from its pages."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    q_start = tl.load(bounds_ptr + c * stride_bc)
    q_len = tl.load(bounds_ptr + c * stride_bc + 1)
    ctx = tl.load(bounds_ptr + c * stride_bc + 2)
    prefix = ctx - q_len  # keys cached before the chunk
    kvh = h // GROUP

    m = m_start + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    pt_row = page_table_ptr + c * stride_pt

    # blocks past a short chunk's queries (the grid is sized for the longest chunk) get empty
    # key ranges: nothing computed, nothing stored
    active = m_start < q_len
    # keys [0, prefix + m_start) are visible to every query of the block; the unmasked loop
    # takes the whole BLOCK_N blocks of them, the masked loop the rest up to the diagonal
    full_end = tl.where(active, ((prefix + m_start) // BLOCK_N) * BLOCK_N, 0)
    diag_end = tl.where(active, prefix + tl.minimum(m_start + BLOCK_M, q_len), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, full_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        page = tl.load(pt_row + n // PAGE_SIZE)
        m_i, l_i, acc = _attend_block(
            q, k_ptr, v_ptr, page, n % PAGE_SIZE, kvh, d, d_mask[None, :], d_mask[None, :],
            m_i, l_i, acc, qk_scale, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, DOT_PRECISION, False)
    # the first block of this loop holds key prefix + m_start, which every row sees, so each
    # row's running max is finite from then on
    for n0 in range(full_end, diag_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < diag_end
        page = tl.load(pt_row + n // PAGE_SIZE, mask=n_mask, other=0)
        in_page = n % PAGE_SIZE
        visible = n_mask[None, :] & (n[None, :] <= prefix + m[:, None])
        m_i, l_i, acc = _attend_block(
            q, k_ptr, v_ptr, page, in_page, kvh, d, n_mask[:, None] & d_mask[None, :],
            visible, m_i, l_i, acc, qk_scale, stride_kp, stride_ks, stride_kh, stride_vp,
            stride_vs, stride_vh, DOT_PRECISION, True)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


#: True when this module's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when
#: triton was first imported): then they take CPU tensors, and nothing else does
INTERPRETED = isinstance(_extend_kernel, InterpretedFunction)
# Triton picks interpreted or compiled per ``@triton.jit`` function when it is defined: its own
# library functions (tl.sum, tl.cdiv, ...) are fixed when triton is imported, these kernels when
# this module is; a mix cannot launch ("Cannot call @triton.jit'd outside of the scope of a
# kernel"), so it is refused here with what to do
if isinstance(tl.sum, InterpretedFunction) != INTERPRETED:
    raise ImportError("TRITON_INTERPRET changed between importing triton and "
                      f"{__name__}: set it (or unset it) before triton is first imported")


def supports_device(device: torch.device) -> bool:
    """True when the kernels can run on ``device``: CUDA, or any device (CPU) in the
    interpreter (which also reads ``TRITON_INTERPRET`` while kernels run, so it must still be
    set)."""
    return device.type == "cuda" or (INTERPRETED and bool(triton.knobs.runtime.interpret))


def _dot_precision(dtype: torch.dtype) -> str:
    # TF32 (Triton's default for float32 dots on GPUs) keeps 10 mantissa bits: a float32 cache
    # asks for float32 results
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16; head sizes that are no power of two are masked
    return max(16, triton.next_power_of_2(head_dim))


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           out: torch.Tensor) -> None:
    """Raises ValueError for what the kernels cannot address: they step over D with unit
    stride, load one dtype and map query head h to KV head h // (H / Hkv)."""
    if q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("q and out need a contiguous last (head_dim) dimension")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache needs a contiguous last (head_dim) dimension")
    if not q.dtype == k_cache.dtype == v_cache.dtype == out.dtype:
        raise ValueError(f"q, the KV cache and out need one dtype, got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}, {out.dtype}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {k_cache.shape[2]} KV "
                         "heads")


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_stages(dtype: torch.dtype) -> int:
    # double-buffered float32 K/V blocks of 64 x 128 plus the queries outgrow the shared memory
    # of GPUs before Hopper (164 KiB on an A100)
    return 1 if dtype == torch.float32 else 2


def default_num_splits(batch: int, num_kv_heads: int, max_keys: int,
                       device: torch.device, max_splits: int = 16) -> int:
    """Splits per decode: enough (request, KV head, split) programs to fill the GPU's SMs
    about twice, no split shorter than 256 keys, at most ``max_splits``; 1 off CUDA.

    All inputs are host integers (shapes), so the choice never syncs with the GPU and a CUDA
    graph captured for one page-table width keeps it."""
    if device.type != "cuda":
        return 1
    sms = _sm_count(device)
    want = -(-2 * sms // max(1, batch * num_kv_heads))
    return max(1, min(want, max_splits, -(-max_keys // 256)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                           scale: float, num_splits: int | None = None) -> None:
    """Attention of one query token per request over its pages (flash-decoding), into ``out``.

    Args:
        q: [B, H, D] queries (any strides with a contiguous last dimension), float32,
            bfloat16 or float16 like the cache.
        k_cache, v_cache: [num_pages, page_size, Hkv, D] one layer's keys and values; H must
            be a multiple of Hkv (GQA: query head h reads KV head h // (H / Hkv)).
        page_table: int64 [B, P] the requests' pages in order (entries past a request's
            length are never read).
        seq_lens: int64 [B] keys per request (>= 1, <= P * page_size), on q's device.
        out: [B, H, D] written in place (contiguous last dimension), q's dtype.
        scale: softmax scale (usually D ** -0.5).
        num_splits: slices per request's keys; None picks ``default_num_splits``.

    Raises:
        ValueError: a last dimension that is not contiguous, mixed dtypes, H not a multiple
            of Hkv, ``num_splits`` < 1.
    """
    _check(q, k_cache, v_cache, out)
    b, h, d = q.shape
    if b == 0:
        return
    _, page_size, hkv, _ = k_cache.shape
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, page_table.shape[1] * page_size, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    group = h // hkv
    block_d = _block_d(d)
    mid_o = torch.empty(b, h, num_splits, d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(b, h, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, mid_o, mid_lse,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=d, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=64 if block_d <= 128 else 32, DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=4, num_stages=_num_stages(q.dtype))
    _decode_merge_kernel[(b, h)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, NUM_SPLITS=num_splits, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_D=block_d, num_warps=4)


def paged_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           bounds: torch.Tensor, page_table: torch.Tensor, max_q_len: int,
                           out: torch.Tensor, scale: float) -> None:
    """Causal attention of prefill chunks over their pages (cached prefix + the chunk's own
    keys, all already written to the pool), into ``out``.

    Args:
        q: [T, H, D] the step's queries (contiguous last dimension); chunk c's are rows
            ``bounds[c, 0] : bounds[c, 0] + bounds[c, 1]``.
        k_cache, v_cache: [num_pages, page_size, Hkv, D] one layer's keys and values.
        bounds: int64 [C, 3] per chunk (first query row in q, query count q_len >= 1,
            context length ctx >= q_len); the chunk's queries are positions
            ``ctx - q_len .. ctx - 1`` of its sequence.
        page_table: int64 [C, P] each chunk's pages (P * page_size >= its ctx).
        max_q_len: the largest q_len (a host integer: it sizes the grid).
        out: [T, H, D] rows of the chunks written in place, q's dtype.
        scale: softmax scale.

    Raises:
        ValueError: a last dimension that is not contiguous, mixed dtypes, H not a multiple
            of Hkv.
    """
    _check(q, k_cache, v_cache, out)
    c = bounds.shape[0]
    if c == 0 or max_q_len == 0:
        return
    _, page_size, hkv, _ = k_cache.shape
    h, d = q.shape[1], q.shape[2]
    block_d = _block_d(d)
    block_m = 64 if block_d <= 128 else 32
    grid = (c, h, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, bounds, page_table,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        bounds.stride(0), page_table.stride(0),
        GROUP=h // hkv, HEAD_DIM=d, PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_m,
        BLOCK_D=block_d, DOT_PRECISION=_dot_precision(q.dtype), num_warps=4,
        num_stages=_num_stages(q.dtype))


def pack_prefill(prefill: list[tuple[int, int, int, torch.Tensor]], page_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``AttentionMetadata.prefill`` as the extend kernel's inputs: bounds int64 [C, 3],
    page table int64 [C, P] (zero-padded) and the largest chunk length. The runner builds
    these once per step from its numpy tables (``AttentionMetadata.prefill_bounds``); this is
    the fall-back for metadata built without them."""
    n_pages = max(-(-ctx // page_size) for _, _, ctx, _ in prefill)
    bounds = torch.tensor([[s, e - s, ctx] for s, e, ctx, _ in prefill], dtype=torch.int64)
    table = torch.zeros(len(prefill), n_pages, dtype=torch.int64, device=device)
    for i, (_, _, ctx, pages) in enumerate(prefill):
        n = -(-ctx // page_size)
        table[i, :n] = pages[:n]
    return bounds.to(device), table, max(e - s for s, e, _, _ in prefill)


class TritonPagedAttention(SdpaPagedAttention):
    """``SdpaPagedAttention``'s K/V write, with decodes through the split-KV decode kernels
    and prefill chunks through the paged extend kernel (all chunks of a step in one launch).

    Args:
        num_heads, num_kv_heads, head_dim: attention sizes (num_heads a multiple of
            num_kv_heads).
        scale: softmax scale.
        num_splits: slices of each decode's keys; None picks per step from the batch and the
            page-table width (``default_num_splits``).
    """

    backend = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 num_splits: int | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.num_splits = num_splits

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, out: torch.Tensor) -> None:
        d = meta.num_decodes
        assert meta.decode_page_table is not None and meta.decode_seq_lens is not None
        paged_decode_attention(q[:d], k_cache, v_cache, meta.decode_page_table,
                               meta.decode_seq_lens, out[:d], self.scale, self.num_splits)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, out: torch.Tensor) -> None:
        if not meta.prefill:
            return
        if meta.prefill_bounds is None or meta.prefill_page_table is None:
            bounds, table, max_q = pack_prefill(meta.prefill, k_cache.shape[1], q.device)
        else:
            bounds, table, max_q = (meta.prefill_bounds, meta.prefill_page_table,
                                    meta.prefill_max_q_len)
        paged_extend_attention(q, k_cache, v_cache, bounds, table, max_q, out, self.scale)
