"""radixserve's CPU kernels: paged decode attention against SDPA over the same pages gathered
in torch, fused add + RMSNorm against ``F.rms_norm``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.model_executor.kernels.cpu import CpuKernels, build


@pytest.fixture(scope="module")
def kernel(kernel_build: str) -> CpuKernels:
    build(march=kernel_build)  # raises with the compiler's message if the build fails
    k = CpuKernels.load(kernel_build)
    assert k is not None
    return k


def _case(seed: int, b: int, h: int, hkv: int, d: int, page: int, max_len: int,
          dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    n_pages = 1 + b * -(-max_len // page) + 3
    kv = torch.randn(2, n_pages, page, hkv, d, generator=g).to(dtype)
    lens = torch.randint(1, max_len + 1, (b,), generator=g)
    lens[0] = max_len
    cols = -(-max_len // page)
    # every sequence gets its own shuffled pages; columns past its length stay the null page 0
    perm = torch.randperm(n_pages - 1, generator=g) + 1
    pt = torch.zeros(b, cols, dtype=torch.int64)
    used = 0
    for i in range(b):
        n = -(-int(lens[i]) // page)
        pt[i, :n] = perm[used:used + n]
        used += n
    # q as a slice of a fused [B, H + Hkv, D] tensor: strided like the model's
    q = torch.randn(b, h + hkv, d, generator=g).to(dtype)[:, :h]
    return kv, pt, lens, q


def _reference(kv, pt, lens, q, scale):
    b, h, d = q.shape
    hkv = kv.shape[3]
    out = torch.empty(b, h, d)
    for i in range(b):
        n = int(lens[i])
        k = kv[0][pt[i]].reshape(-1, hkv, d)[:n].float().transpose(0, 1)
        v = kv[1][pt[i]].reshape(-1, hkv, d)[:n].float().transpose(0, 1)
        o = F.scaled_dot_product_attention(q[i].float().unsqueeze(1), k, v, scale=scale,
                                           enable_gqa=True)
        out[i] = o.squeeze(1)
    return out


@pytest.mark.parametrize(("b", "h", "hkv", "d", "page", "max_len"), [
    (1, 4, 4, 64, 16, 1),        # one key
    (1, 9, 3, 64, 16, 300),      # one sequence: tasks split by KV head
    (7, 9, 3, 64, 16, 97),       # SmolLM2's GQA shape, odd lengths
    (16, 8, 2, 128, 1, 40),      # page size 1
    (5, 6, 1, 24, 4, 33),        # multi-query, D % 8 == 0
    (6, 4, 2, 20, 3, 29),        # D % 8 != 0: the scalar path
    (33, 2, 2, 16, 8, 64),       # no GQA
])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_sdpa_float32(kernel, b, h, hkv, d, page, max_len, threads) -> None:
    kv, pt, lens, q = _case(b * 100 + d, b, h, hkv, d, page, max_len, torch.float32)
    out = torch.full((b, h, d), float("nan"))
    scale = d ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel.paged_decode_attention(q, kv[0], kv[1], pt, lens, out, scale)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, _reference(kv, pt, lens, q, scale), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("b", "h", "hkv", "d", "page", "max_len"), [
    (5, 9, 3, 64, 16, 70),       # SmolLM2's GQA: three heads share each value row
    (1, 9, 3, 64, 16, 300),      # one sequence: tasks split by KV head
    (4, 10, 2, 64, 16, 45),      # five heads per KV head: register sets of 4 and 1
    (3, 14, 2, 128, 16, 90),     # seven heads per KV head at D 128: sets of 2, 2, 2, 1
    (6, 4, 4, 128, 1, 33),       # no GQA, page size 1
    (4, 6, 2, 96, 8, 40),        # D 96: AVX512-BF16 scores, portable P.V
    (3, 6, 1, 24, 4, 33),        # D % 32 != 0: the portable path throughout
])
def test_kernel_bfloat16(kernel, b, h, hkv, d, page, max_len) -> None:
    kv, pt, lens, q = _case(3 + d, b, h, hkv, d, page, max_len, torch.bfloat16)
    out = torch.empty(b, h, d, dtype=torch.bfloat16)
    scale = d ** -0.5
    kernel.paged_decode_attention(q, kv[0], kv[1], pt, lens, out, scale)
    ref = _reference(kv, pt, lens, q, scale)  # float32 math on the same bf16 inputs
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_bf16_attention_isa_follows_the_cpu(kernel, kernel_build) -> None:
    """The native build's instruction-set paths must be the CPU's own; the haswell build's
    those of an AVX2 CPU (portable attention, float32 linears with AVX2 + FMA)."""
    flags = set()
    for line in open("/proc/cpuinfo").read().splitlines():  # noqa: SIM115 - small file
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if kernel_build == "haswell":
        flags = {"avx2", "fma"}
    want = ("avx512-bf16" if {"avx512f", "avx512_bf16"} <= flags
            else "avx512" if "avx512f" in flags else "portable")
    assert kernel.bf16_attention_isa == want
    assert kernel.has_bf16_dot == (want == "avx512-bf16")
    assert kernel.f32_gemm_isa == ("avx512" if "avx512f" in flags
                                   else "avx2" if {"avx2", "fma"} <= flags else None)


def test_kernel_rejects_bad_input(kernel) -> None:
    kv, pt, lens, q = _case(1, 2, 4, 2, 16, 4, 8, torch.float32)
    out = torch.empty(2, 4, 16)
    bad = pt.clone()
    bad[0, 0] = kv.shape[1]  # past the pool
    with pytest.raises(RuntimeError, match="code 4"):
        kernel.paged_decode_attention(q, kv[0], kv[1], bad, lens, out, 0.25)
    with pytest.raises(RuntimeError, match="code 2"):
        kernel.paged_decode_attention(q, kv[0], kv[1], pt, torch.tensor([9, 1]), out, 0.25)  # > 2 pages x 4
    with pytest.raises(RuntimeError, match="code 2"):
        kernel.paged_decode_attention(q, kv[0], kv[1], pt, torch.tensor([0, 1]), out, 0.25)
    with pytest.raises(ValueError, match="dtypes"):
        kernel.paged_decode_attention(q.double(), kv[0], kv[1], pt, lens, out, 0.25)
    with pytest.raises(ValueError, match="int64"):
        kernel.paged_decode_attention(q, kv[0], kv[1], pt.int(), lens, out, 0.25)
    with pytest.raises(ValueError, match="contiguous"):
        kernel.paged_decode_attention(q, kv[0], kv[1], pt, lens, out.transpose(0, 1), 0.25)


def test_build_reports_compiler_failure(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="failed"):
        build(compiler="false")  # a "compiler" that always exits 1


@pytest.mark.parametrize(("m", "n"), [(1, 576), (3, 17), (130, 576), (64, 2048)])
@pytest.mark.parametrize("add", [False, True])
def test_add_rms_norm_matches_torch(kernel, m, n, add) -> None:
    g = torch.Generator().manual_seed(m * n)
    x = torch.randn(m, n, generator=g)
    residual = torch.randn(m, n, generator=g) * 3
    weight = torch.rand(n, generator=g) + 0.5
    want_res = residual + x if add else residual.clone()
    want = F.rms_norm(want_res, (n,), weight, 1e-5)
    got = kernel.add_rms_norm(x if add else None, residual, weight, 1e-5)
    torch.testing.assert_close(residual, want_res, atol=0, rtol=0)  # updated in place
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("add", [False, True])
def test_add_rms_norm_out_over_x_gives_the_same_bits(kernel, dtype, add) -> None:
    """A prefill layer writes the normed rows over x (``out=x``): each row of x is read before
    that row of out is written, so the bits are those of a fresh output."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(130, 576, generator=g).to(dtype)
    residual = (torch.randn(130, 576, generator=g) * 3).to(dtype)
    weight = (torch.rand(576, generator=g) + 0.5).to(dtype)
    r1, r2, x2 = residual.clone(), residual.clone(), x.clone()
    want = kernel.add_rms_norm(x if add else None, r1, weight, 1e-5)
    got = kernel.add_rms_norm(x2 if add else None, r2, weight, 1e-5, out=x2)
    assert got.data_ptr() == x2.data_ptr()
    assert torch.equal(got, want) and torch.equal(r2, r1)


def test_add_rms_norm_rejects_bad_input(kernel) -> None:
    r = torch.randn(4, 8)
    with pytest.raises(ValueError, match="float32"):
        kernel.add_rms_norm(None, r.double(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="one dtype"):
        kernel.add_rms_norm(None, r.bfloat16(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        kernel.add_rms_norm(torch.randn(4, 7), r, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        kernel.add_rms_norm(None, r.t(), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="float32"):
        kernel.add_rms_norm(None, r, torch.ones(8), 1e-6, out=torch.empty(4, 8).bfloat16())
    with pytest.raises(ValueError, match="overlap"):
        kernel.add_rms_norm(None, r, torch.ones(8), 1e-6, out=r)


@pytest.mark.parametrize(("m", "n"), [(1, 576), (3, 17), (130, 576)])
@pytest.mark.parametrize("add", [False, True])
def test_add_rms_norm_bf16_equals_the_eager_bf16_ops(kernel, m, n, add) -> None:
    from radixserve.model_executor.models.llama import rms_norm

    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, n, generator=g).bfloat16()
    residual = (torch.randn(m, n, generator=g) * 3).bfloat16()
    weight = (torch.rand(n, generator=g) + 0.5).bfloat16()
    want_res = residual + x if add else residual.clone()
    want = rms_norm(want_res, weight, 1e-5)  # transformers' LlamaRMSNorm on bf16
    got = kernel.add_rms_norm(x if add else None, residual, weight, 1e-5)
    assert torch.equal(residual, want_res)
    # the mean's summation order differs from torch's: a rare last-bit difference
    torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_rope_in_place_equals_apply_rope_bitwise(kernel, dtype, threads) -> None:
    from radixserve.model_executor.models.llama import apply_rope

    g = torch.Generator().manual_seed(7)
    t, nq, nkv, d = 300, 9, 3, 64
    qkv = torch.randn(t, (nq + 2 * nkv) * d, generator=g).to(dtype)
    qk = qkv[:, :(nq + nkv) * d].view(t, nq + nkv, d)  # a strided view, as in the layer
    freqs = torch.randint(0, 8192, (t, 1), generator=g).float() * (
        1.0 / 100000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    want = apply_rope(qk, cos.unsqueeze(1), sin.unsqueeze(1))
    v_before = qkv[:, (nq + nkv) * d:].clone()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert kernel.rope_(qk, cos, sin) is qk
    finally:
        torch.set_num_threads(before)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, (nq + nkv) * d:], v_before)  # V untouched
    with pytest.raises(ValueError, match="rope_"):
        kernel.rope_(qk, cos[:-1], sin[:-1])
    with pytest.raises(ValueError, match="rope_"):
        kernel.rope_(qk.transpose(0, 1), cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("i", [1536, 13, 40])  # a tail shorter than the 16 lanes
def test_silu_mul_matches_torch(kernel, dtype, i) -> None:
    g = torch.Generator().manual_seed(i)
    gu = (torch.randn(37, 2 * i, generator=g) * 4).to(dtype)
    gu[0, :4] = torch.tensor([30.0, -30.0, 0.0, -0.0]).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = kernel.silu_mul(gu)
    assert got.dtype == dtype and got.shape == (37, i)
    if dtype == torch.bfloat16:
        # the SiLU is rounded to bf16 as torch's op is: equal but for a rare last bit
        assert (got != want).float().mean() < 1e-3
        torch.testing.assert_close(got, want, atol=1e-30, rtol=2 ** -7)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="silu_mul"):
        kernel.silu_mul(gu[:, :-1])


@pytest.mark.parametrize(("rows", "vocab"), [(64, 49152), (3, 17), (2, 5), (5, 1)])
def test_argmax_rows_matches_torch(kernel, rows, vocab) -> None:
    g = torch.Generator().manual_seed(vocab)
    # bf16-rounded logits: many exact ties, where the first index must win as in torch
    x = torch.randn(rows, vocab, generator=g).bfloat16().float()
    assert torch.equal(kernel.argmax_rows(x), x.argmax(dim=-1))
    wide = torch.randn(rows, vocab + 7, generator=g)
    assert torch.equal(kernel.argmax_rows(wide[:, 3:vocab + 3]),
                       wide[:, 3:vocab + 3].argmax(dim=-1))  # strided rows


def test_argmax_rows_edge_values(kernel) -> None:
    x = torch.randn(5, 100)
    x[0, 40] = x[0, 90] = float("inf")
    x[1, 70] = x[1, 20] = float("nan")  # torch: the first NaN wins
    x[2] = float("-inf")
    x[3] = 1.0
    x[4, 99] = 1e30  # in the scalar tail past the last 16 lanes
    got = kernel.argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1)) and got.tolist() == [40, 20, 0, 0, 99]
    with pytest.raises(ValueError, match="argmax_rows"):
        kernel.argmax_rows(x.bfloat16())
    with pytest.raises(ValueError, match="argmax_rows"):
        kernel.argmax_rows(x.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_index_copy(kernel, dtype) -> None:
    g = torch.Generator().manual_seed(7)
    pages, page, hkv, d, t = 6, 4, 3, 8, 5
    caches = torch.randn(2, pages, page, hkv, d, generator=g).to(dtype)
    # K and V as views of a fused [T, (H + 2 Hkv) * D] projection output, as in the model
    qkv = torch.randn(t, (9 + 2 * hkv) * d, generator=g).to(dtype)
    k = qkv[:, 9 * d:(9 + hkv) * d].view(t, hkv, d)
    v = qkv[:, (9 + hkv) * d:].view(t, hkv, d)
    slots = torch.tensor([23, 0, 5, 6, 17])
    want = caches.clone()
    want[0].view(-1, hkv, d).index_copy_(0, slots, k)
    want[1].view(-1, hkv, d).index_copy_(0, slots, v)
    kernel.store_kv(k, v, caches[0], caches[1], slots)
    assert torch.equal(caches, want)
    before = caches.clone()
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel.store_kv(k, v, caches[0], caches[1], torch.tensor([1, 2, 3, 24, 4]))
    assert torch.equal(caches, before)  # nothing written
    with pytest.raises(ValueError, match="store_kv"):
        kernel.store_kv(k, v, caches[0], caches[1], slots.int())


# -- paged prefill attention -----------------------------------------------------------------


def _prefill_case(seed: int, h: int, hkv: int, d: int, page: int, ctx: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    n_pages = -(-ctx // page)
    kv = torch.randn(2, n_pages + 4, page, hkv, d, generator=g).to(dtype)
    pages = torch.randperm(n_pages + 3, generator=g)[:n_pages] + 1  # shuffled, never page 0
    q = torch.randn(ctx, h + hkv, d, generator=g).to(dtype)[:, :h]  # strided like the model's
    return kv, pages, q


PREFILL_SHAPES = [
    (9, 3, 64, 16, 1),      # one token
    (9, 3, 64, 16, 97),     # SmolLM2's GQA shape, tiles of 16 rows and a partial one
    (8, 2, 128, 1, 40),     # page size 1, head_dim 128
    (14, 2, 128, 16, 50),   # seven heads per KV head at D 128
    (6, 2, 96, 8, 37),      # D 96
    (6, 1, 24, 4, 33),      # multi-query
    (4, 2, 20, 3, 29),      # D % 8 != 0: the scalar path
    (2, 2, 16, 8, 70),      # no GQA
]


@pytest.mark.parametrize(("h", "hkv", "d", "page", "ctx"), PREFILL_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_kernel_is_the_decode_kernel_row_by_row(kernel, h, hkv, d, page, ctx, dtype,
                                                         threads) -> None:
    """Every prefill row equals, bit for bit, a decode of that token over the same context, and
    any chunking of the prompt gives the very same rows: the kernel's batch invariance."""
    kv, pages, q = _prefill_case(ctx * 7 + d, h, hkv, d, page, ctx, dtype)
    scale = d ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        whole = torch.full((ctx, h, d), float("nan"), dtype=dtype)
        kernel.paged_prefill_attention(q, kv[0], kv[1], pages, ctx, whole, scale)
        decoded = torch.full((ctx, h, d), float("nan"), dtype=dtype)
        # one decode per position, all reading one page-table row (row stride 0)
        kernel.paged_decode_attention(q, kv[0], kv[1], pages.unsqueeze(0).expand(ctx, -1),
                                      torch.arange(1, ctx + 1), decoded, scale)
        chunked = torch.full((ctx, h, d), float("nan"), dtype=dtype)
        cuts = sorted({0, ctx // 3, ctx // 3 + 1, max(ctx - 5, 0), ctx})
        for a, b in zip(cuts, cuts[1:], strict=False):
            kernel.paged_prefill_attention(q[a:b], kv[0], kv[1], pages, b, chunked[a:b], scale)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(whole, decoded)
    assert torch.equal(whole, chunked)
    # and it is causal attention: SDPA over the gathered pages, float32 math
    k = kv[0][pages].reshape(-1, hkv, d)[:ctx].float().transpose(0, 1)
    v = kv[1][pages].reshape(-1, hkv, d)[:ctx].float().transpose(0, 1)
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, is_causal=True,
                                         scale=scale, enable_gqa=True).transpose(0, 1)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(whole.float(), ref, atol=tol, rtol=tol * 5)


def test_prefill_kernel_rejects_bad_input(kernel) -> None:
    kv, pages, q = _prefill_case(1, 4, 2, 16, 4, 8, torch.float32)
    out = torch.empty(8, 4, 16)
    bad = pages.clone()
    bad[0] = kv.shape[1]  # past the pool
    with pytest.raises(RuntimeError, match="code 4"):
        kernel.paged_prefill_attention(q, kv[0], kv[1], bad, 8, out, 0.25)
    with pytest.raises(RuntimeError, match="code 2"):  # more keys than the pages hold
        kernel.paged_prefill_attention(q, kv[0], kv[1], pages, 9, out, 0.25)
    with pytest.raises(RuntimeError, match="code 2"):  # fewer keys than queries
        kernel.paged_prefill_attention(q, kv[0], kv[1], pages, 7, out, 0.25)
    with pytest.raises(ValueError, match="dtypes"):
        kernel.paged_prefill_attention(q.double(), kv[0], kv[1], pages, 8, out, 0.25)
    with pytest.raises(ValueError, match="contiguous"):
        kernel.paged_prefill_attention(q, kv[0], kv[1], pages, 8, out.transpose(0, 1), 0.25)


@pytest.mark.parametrize(("h", "hkv", "d", "page"), [(9, 3, 64, 16), (8, 2, 128, 4),
                                                     (4, 4, 64, 1), (6, 2, 96, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_verify_runs_compute_each_row_as_a_decode(kernel, h, hkv, d, page, dtype,
                                                  threads) -> None:
    """A speculating request's k + 1 verify rows are consecutive decode rows at consecutive
    lengths over one sequence's pages (the kernel may give them shared tasks): among plain
    decodes, and two runs back to back, every row equals, bit for bit, that row decoded
    alone."""
    g = torch.Generator().manual_seed(d + page)
    n_pages = 64
    kv = torch.randn(2, n_pages, page, hkv, d, generator=g).to(dtype)
    cols = -(-70 // page)
    seq_pages = [torch.randperm(n_pages, generator=g)[:cols] for _ in range(4)]
    # rows: a decode, a run of 5 (lengths 40..44), a run of 3 right after it (another
    # sequence), a decode of the first run's sequence at a length that does not continue it
    rows = [(0, 23)] + [(1, 40 + i) for i in range(5)] + [(2, 61 + i) for i in range(3)] + [
        (1, 30), (3, 1), (3, 2)]
    pt = torch.stack([seq_pages[s] for s, _ in rows]).contiguous()
    lens = torch.tensor([n for _, n in rows], dtype=torch.int64)
    q = torch.randn(len(rows), h + hkv, d, generator=g).to(dtype)[:, :h]
    scale = d ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full((len(rows), h, d), float("nan"), dtype=dtype)
        kernel.paged_decode_attention(q, kv[0], kv[1], pt, lens, out, scale)
        for i in range(len(rows)):
            alone = torch.full((1, h, d), float("nan"), dtype=dtype)
            kernel.paged_decode_attention(q[i:i + 1], kv[0], kv[1], pt[i:i + 1], lens[i:i + 1],
                                          alone, scale)
            assert torch.equal(out[i], alone[0]), i
    finally:
        torch.set_num_threads(before)
    ref = _reference(kv, pt, lens, q, scale)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol * 5)
