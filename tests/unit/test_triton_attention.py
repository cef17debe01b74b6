"""radixserve's Triton paged attention (``--attention-backend triton``) against the SDPA
reference (``SdpaPagedAttention``) on random data, run on CPU in Triton's interpreter (the
``triton_attention`` fixture, tests/conftest.py).

Dtypes: float32 (tight), float16, and bfloat16 through a corrected interpreter dot: Triton's
interpreter stores bfloat16 as uint16 and its ``tl.dot`` multiplies those bit patterns
(triton-lang/triton#11584; the interpreter does not support bfloat16, per Triton's debugging
guide), so the bfloat16 cases patch that one interpreter op to convert the operands first. The
kernels themselves run unchanged; on a GPU ``tl.dot`` takes bfloat16 natively.
"""

from __future__ import annotations

import sys

import pytest
import torch

from radixserve.model_executor.attention.paged_attention import (
    AttentionMetadata,
    SdpaPagedAttention,
)

#: largest |triton - reference| per dtype: float32 against float32 SDPA; the 16-bit dtypes
#: against float32 SDPA over the same (rounded) inputs, so the bound is the kernel's own
#: rounding (output and softmax weights in 16 bits)
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture
def dtype(request, monkeypatch) -> torch.dtype:
    """The case's dtype; for bfloat16 the interpreter's ``tl.dot`` converts bfloat16 operands
    to float32 (exact) before multiplying, instead of multiplying their bit patterns."""
    dt = request.param
    if dt == torch.bfloat16:
        import triton.language as tl
        from triton.runtime import interpreter

        orig = interpreter.InterpreterBuilder.create_dot

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
            if a.dtype.scalar == tl.bfloat16:
                a = self.cast_impl(a, tl.float32)
            if b.dtype.scalar == tl.bfloat16:
                b = self.cast_impl(b, tl.float32)
            return orig(self, a, b, d, input_precision, max_num_imprecise_acc)

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    return dt


def scattered_pages(lens: list[int], page_size: int, num_pages: int,
                    g: torch.Generator) -> list[torch.Tensor]:
    """Each sequence's pages: distinct, shuffled over the pool (never the null page 0)."""
    need = sum(-(-n // page_size) for n in lens)
    assert need <= num_pages - 1
    perm = torch.randperm(num_pages - 1, generator=g) + 1
    out, used = [], 0
    for n in lens:
        k = -(-n // page_size)
        out.append(perm[used:used + k].clone())
        used += k
    return out


def padded_table(pages: list[torch.Tensor]) -> torch.Tensor:
    """int64 [B, max pages], the null page 0 past each sequence's own."""
    pt = torch.zeros(len(pages), max(len(p) for p in pages), dtype=torch.int64)
    for i, p in enumerate(pages):
        pt[i, :len(p)] = p
    return pt


def decode_meta(pt: torch.Tensor, lens: list[int], page_size: int,
                slots: torch.Tensor | None = None) -> AttentionMetadata:
    """Decode-only metadata in both layouts (SDPA's key mask and the kernels' lengths)."""
    seq = torch.tensor(lens, dtype=torch.int64)
    mask = torch.arange(pt.shape[1] * page_size)[None, :] < seq[:, None]
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64) if slots is None else slots,
        num_decodes=len(lens), decode_page_table=pt, decode_seq_lens=seq,
        decode_mask=mask[:, None, None, :], prefill=[])


def case(h: int, hkv: int, d: int, page_size: int, lens: list[int], dtype: torch.dtype,
         seed: int, tokens: int | None = None):
    """A random pool [2, N, page, Hkv, D], pages per sequence and queries [T, H, D] strided
    like the model's (a slice of a fused [T, H + Hkv, D] tensor)."""
    g = torch.Generator().manual_seed(seed)
    num_pages = 1 + sum(-(-n // page_size) for n in lens) + 5
    kv = torch.randn(2, num_pages, page_size, hkv, d, generator=g).to(dtype)
    pages = scattered_pages(lens, page_size, num_pages, g)
    t = len(lens) if tokens is None else tokens
    q = torch.randn(t, h + hkv, d, generator=g).to(dtype)[:, :h]
    return kv, pages, q


def reference(h: int, hkv: int, d: int):
    return SdpaPagedAttention(h, hkv, d, d ** -0.5)


SHAPES = [pytest.param(9, 3, 64, 16, id="smollm2-h9-kv3-d64-page16"),
          pytest.param(4, 2, 128, 4, id="h4-kv2-d128-page4")]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES, indirect=True)
@pytest.mark.parametrize(("h", "hkv", "d", "page_size"), SHAPES)
def test_decode_matches_sdpa(triton_attention, h: int, hkv: int, d: int, page_size: int,
                             dtype: torch.dtype) -> None:
    """Lengths of 1, within a page, on and off page boundaries and over several key blocks
    (64 keys each), on scattered pages; one split, a few, and more splits than blocks (empty
    splits); every split count must give the reference's result."""
    lens = [1, 5, page_size, 2 * page_size + 3, 64, 131, 200]
    kv, pages, q = case(h, hkv, d, page_size, lens, dtype, seed=1)
    pt = padded_table(pages)
    meta = decode_meta(pt, lens, page_size)
    want = torch.empty(q.shape, dtype=torch.float32)
    qf, kvf = q.float(), kv.float()
    reference(h, hkv, d)._decode(qf, kvf[0], kvf[1], meta, want)
    assert want.abs().max() > 0.1  # the comparison below is not of two near-zero tensors
    # the 16-bit cases round the same arithmetic differently: two split counts do for them
    for splits in (1, 3, 8) if dtype == torch.float32 else (1, 8):
        got = torch.full(q.shape, float("nan"), dtype=dtype)
        triton_attention.paged_decode_attention(q, kv[0], kv[1], pt, meta.decode_seq_lens,
                                                got, d ** -0.5, splits)
        err = (got.float() - want).abs().max().item()
        assert err <= TOL[dtype], f"{splits} splits: max error {err}"


def test_decode_reads_only_its_own_pages(triton_attention) -> None:
    """Keys past a sequence's length and pages of other sequences are never read: poisoning
    them (NaN) changes nothing."""
    h, hkv, d, ps = 4, 2, 64, 4
    lens = [3, 9, 70]
    kv, pages, q = case(h, hkv, d, ps, lens, torch.float32, seed=2)
    pt = padded_table(pages)
    meta = decode_meta(pt, lens, ps)
    want = torch.empty(q.shape)
    triton_attention.paged_decode_attention(q, kv[0], kv[1], pt, meta.decode_seq_lens, want,
                                            d ** -0.5, 2)
    poisoned = torch.full_like(kv, float("nan"))
    for p, n in zip(pages, lens, strict=True):
        flat = torch.cat([torch.arange(int(x) * ps, int(x) * ps + ps) for x in p])[:n]
        poisoned.view(2, -1, hkv, d)[:, flat] = kv.view(2, -1, hkv, d)[:, flat]
    got = torch.empty(q.shape)
    triton_attention.paged_decode_attention(q, poisoned[0], poisoned[1], pt,
                                            meta.decode_seq_lens, got, d ** -0.5, 2)
    assert torch.equal(got, want)


def prefill_case(h: int, hkv: int, d: int, page_size: int, chunks: list[tuple[int, int]],
                 dtype: torch.dtype, seed: int):
    """Prefill chunks given as (query count, context length), packed one after another."""
    kv, pages, _ = case(h, hkv, d, page_size, [c for _, c in chunks], dtype, seed)
    t = sum(n for n, _ in chunks)
    g = torch.Generator().manual_seed(seed + 100)
    q = torch.randn(t, h + hkv, d, generator=g).to(dtype)[:, :h]
    prefill, start = [], 0
    for (n, ctx), p in zip(chunks, pages, strict=True):
        prefill.append((start, start + n, ctx, p))
        start += n
    return kv, q, prefill


@pytest.mark.parametrize("dtype", DTYPES, indirect=True)
@pytest.mark.parametrize(("h", "hkv", "d", "page_size"), SHAPES)
def test_prefill_matches_sdpa(triton_attention, h: int, hkv: int, d: int, page_size: int,
                              dtype: torch.dtype) -> None:
    """Chunks without a prefix (whole prompts, one over several query blocks) and extends
    over cached pages (prefix longer than the chunk, a one-token extend), in one launch."""
    chunks = [(3, 3), (70, 200), (1, 9), (130, 130), (5, 67)]
    kv, q, prefill = prefill_case(h, hkv, d, page_size, chunks, dtype, seed=3)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), num_decodes=0,
                             decode_page_table=None, decode_seq_lens=None, decode_mask=None,
                             prefill=prefill)
    want = torch.empty(q.shape, dtype=torch.float32)
    qf, kvf = q.float(), kv.float()
    reference(h, hkv, d)._prefill(qf, kvf[0], kvf[1], meta, want)
    got = torch.full(q.shape, float("nan"), dtype=dtype)
    attn = triton_attention.TritonPagedAttention(h, hkv, d, d ** -0.5)
    attn._prefill(q, kv[0], kv[1], meta, got)  # packs meta.prefill itself
    err = (got.float() - want).abs().max().item()
    assert err <= TOL[dtype], f"max error {err}"


def test_prefill_is_causal(triton_attention) -> None:
    """A query must not see later keys: changing the chunk's last key changes only the last
    query's output."""
    h, hkv, d, ps = 4, 2, 16, 4
    kv, q, prefill = prefill_case(h, hkv, d, ps, [(20, 50)], torch.float32, seed=4)
    bounds, table, max_q = triton_attention.pack_prefill(prefill, ps, torch.device("cpu"))
    outs = []
    for last in (0.0, 5.0):
        kv2 = kv.clone()
        page = int(prefill[0][3][49 // ps])
        kv2[:, page, 49 % ps] = last
        o = torch.empty(q.shape)
        triton_attention.paged_extend_attention(q, kv2[0], kv2[1], bounds, table, max_q, o,
                                                d ** -0.5)
        outs.append(o)
    assert torch.equal(outs[0][:19], outs[1][:19])
    assert not torch.equal(outs[0][19], outs[1][19])


@pytest.mark.parametrize("packed", [True, False], ids=["runner-packed", "self-packed"])
def test_mixed_step_forward(triton_attention, packed: bool) -> None:
    """A mixed step through ``forward``: three decodes then two prefill chunks (one extending
    cached pages), K/V written first. Output equals the reference's, the new K/V land in
    exactly their slots and nothing else in the pool changes."""
    h, hkv, d, ps = 9, 3, 64, 4
    dec_lens = [1, 6, 70]
    chunks = [(7, 30), (12, 12)]  # (new tokens, context): 23 cached, then a fresh prompt
    lens = dec_lens + [c for _, c in chunks]
    g = torch.Generator().manual_seed(5)
    num_pages = 1 + sum(-(-n // ps) for n in lens) + 4
    pool = torch.randn(2, num_pages, ps, hkv, d, generator=g)
    pages = scattered_pages(lens, ps, num_pages, g)
    # the step's tokens: each decode's last position, each chunk's last n positions
    positions = [[n - 1] for n in dec_lens] + [list(range(c - n, c)) for n, c in chunks]
    slots = torch.cat([torch.tensor([int(p[x // ps]) * ps + x % ps for x in pos])
                       for p, pos in zip(pages, positions, strict=True)])
    t = len(slots)
    qkv = torch.randn(t, h + 2 * hkv, d, generator=g)
    q, k, v = qkv[:, :h], qkv[:, h:h + hkv], qkv[:, h + hkv:]
    meta = decode_meta(padded_table(pages[:3]), dec_lens, ps, slots)
    start = len(dec_lens)
    for (n, ctx), p in zip(chunks, pages[3:], strict=True):
        meta.prefill.append((start, start + n, ctx, p))
        start += n
    if packed:
        meta.prefill_bounds, meta.prefill_page_table, meta.prefill_max_q_len = (
            triton_attention.pack_prefill(meta.prefill, ps, torch.device("cpu")))

    ref_pool = pool.clone()
    want = reference(h, hkv, d).forward(q, k, v, ref_pool, meta)
    got_pool = pool.clone()
    got = triton_attention.TritonPagedAttention(h, hkv, d, d ** -0.5, num_splits=2).forward(
        q, k, v, got_pool, meta)
    assert got.shape == (t, h * d)
    assert (got - want).abs().max().item() <= TOL[torch.float32]
    flat = got_pool.view(2, -1, hkv, d)
    assert torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], pool.view(2, -1, hkv, d)[:, untouched])
    assert torch.equal(got_pool, ref_pool)


def test_rejects_bad_layouts(triton_attention) -> None:
    kv = torch.zeros(2, 4, 4, 2, 16)
    out = torch.empty(1, 4, 16)
    pt = torch.ones(1, 1, dtype=torch.int64)
    lens = torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="contiguous last"):
        triton_attention.paged_decode_attention(torch.zeros(1, 16, 4).transpose(1, 2), kv[0],
                                                kv[1], pt, lens, out, 0.25)
    with pytest.raises(ValueError, match="do not group"):
        triton_attention.paged_decode_attention(torch.zeros(1, 3, 16), kv[0], kv[1], pt, lens,
                                                torch.empty(1, 3, 16), 0.25)
    with pytest.raises(ValueError, match="num_splits=0"):
        triton_attention.paged_decode_attention(torch.zeros(1, 4, 16), kv[0], kv[1], pt, lens,
                                                out, 0.25, 0)


def test_backend_selection(triton_attention, monkeypatch: pytest.MonkeyPatch) -> None:
    """"triton" builds the Triton attention with torch element-wise ops; "auto" stays the C
    kernels on CPU and takes Triton on CUDA when it imports, SDPA (a reported fall-back) when
    not; "triton" where the kernels cannot run is an error naming why."""
    import radixserve.model_executor.attention as attention_pkg
    from radixserve.config import ATTENTION_BACKENDS, EngineConfig
    from radixserve.model_executor.attention.registry import build_attention
    from radixserve.model_executor.device_policy import select_cpu_kernels, select_triton

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "triton" in ATTENTION_BACKENDS
    assert EngineConfig(attention_backend="triton").attention_backend == "triton"
    attn = build_attention("triton", 9, 3, 64, 0.125)
    assert isinstance(attn, triton_attention.TritonPagedAttention) and attn.backend == "triton"
    assert select_cpu_kernels("triton", cpu, torch.float32) is None
    assert select_triton("triton", cpu) == (True, None)  # interpreted, in this test
    assert select_triton("auto", cpu) == (False, None)
    assert select_triton("torch", cuda) == (False, None)
    assert select_triton("auto", cuda) == (True, None)  # a device object: nothing allocated
    assert select_triton("triton", cuda, torch.bfloat16) == (True, None)
    with pytest.raises(ValueError, match="bfloat16"):
        select_triton("triton", cpu, torch.bfloat16)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="runs on CUDA, not cpu"):
        select_triton("triton", cpu)
    # triton missing: "auto" falls back with the reason, "triton" is an error
    monkeypatch.delattr(attention_pkg, "triton_attention")
    monkeypatch.setitem(sys.modules, triton_attention.__name__, None)
    use, why = select_triton("auto", cuda)
    assert not use and why is not None and "does not import" in why
    with pytest.raises(ValueError, match="needs the triton package"):
        select_triton("triton", cuda)
