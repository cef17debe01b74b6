"""radixserve's Triton layer kernels (``kernels.triton_ops``: residual add + RMSNorm, RoPE in
place, SiLU-mul) against the torch reference ops of ``models.llama``, on CPU in Triton's
interpreter (the ``triton_layer_ops`` fixture, tests/conftest.py), and a tiny model's forward
with them against the torch path.

Dtypes: float32 and float16, whose roundings the interpreter reproduces (numpy has both). The
interpreter holds bfloat16 as raw uint16 and does not round to it like a GPU, so bfloat16 is
checked on a GPU (benchmarks/gpu/test_cuda_parity.py); the kernels take the same code path for
float16 and bfloat16 (``ROUND``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.model_executor.models.llama import apply_rope, rms_norm

DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 96, 576])
def test_add_rms_norm_matches_torch(triton_layer_ops, dtype: torch.dtype, n: int) -> None:
    g = torch.Generator().manual_seed(n)
    res = torch.randn(7, n, generator=g).to(dtype)
    x = torch.randn(7, n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    ops = triton_layer_ops.TritonLayerOps()
    r = res.clone()
    out = ops.add_rms_norm(x, r, w, 1e-6)
    want_r = res + x
    assert torch.equal(r, want_r), "the residual is updated in place to res + x"
    want = rms_norm(want_r, w, 1e-6)
    # the mean square is summed in another order than torch's: the last bit may differ
    torch.testing.assert_close(out, want, rtol=0, atol=2e-6 if dtype == torch.float32 else 2e-3)
    r2 = res.clone()
    out2 = ops.add_rms_norm(None, r2, w, 1e-6)
    assert torch.equal(r2, res), "no x: the residual is left alone"
    torch.testing.assert_close(out2, rms_norm(res, w, 1e-6), rtol=0,
                               atol=2e-6 if dtype == torch.float32 else 2e-3)
    r3, x3 = res.clone(), x.clone()
    out3 = ops.add_rms_norm(x3, r3, w, 1e-6, out=x3)
    assert out3.data_ptr() == x3.data_ptr(), "out= is written, x itself included"
    assert torch.equal(out3, out) and torch.equal(r3, want_r)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_a_view_of_fused_qkv(triton_layer_ops, dtype: torch.dtype) -> None:
    """Q and K are a strided view of the fused projection's output; V's columns are untouched."""
    g = torch.Generator().manual_seed(1)
    t, nq, nkv, d = 5, 6, 2, 16
    qkv = torch.randn(t, (nq + 2 * nkv) * d, generator=g).to(dtype)
    before = qkv.clone()
    qk = qkv[:, :(nq + nkv) * d].view(t, nq + nkv, d)
    cos = torch.randn(t, d // 2, generator=g).to(dtype)
    sin = torch.randn(t, d // 2, generator=g).to(dtype)
    want = apply_rope(qk.clone(), cos.unsqueeze(1), sin.unsqueeze(1))
    out = triton_layer_ops.TritonLayerOps().rope_(qk, cos, sin)
    assert out is qk
    assert torch.equal(qk, want), "the same roundings as apply_rope"
    assert torch.equal(qkv[:, (nq + nkv) * d:], before[:, (nq + nkv) * d:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 1536, 2100])
def test_silu_mul_matches_torch(triton_layer_ops, dtype: torch.dtype, inter: int) -> None:
    g = torch.Generator().manual_seed(inter)
    gu = (3 * torch.randn(3, 2 * inter, generator=g)).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    out = triton_layer_ops.TritonLayerOps().silu_mul(gu)
    want = F.silu(gate) * up
    # exp differs from torch's in its last bits: a few float32 ulp, which in float16 rarely
    # moves the rounded SiLU by one ulp (then ~2 ulp after the product)
    torch.testing.assert_close(out, want, atol=0, rtol=5e-7 if dtype == torch.float32 else 2e-3)
    if dtype != torch.float32:
        assert (out != want).float().mean() < 0.005


def test_bad_input_is_refused(triton_layer_ops) -> None:
    ops = triton_layer_ops.TritonLayerOps()
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        ops.silu_mul(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="even"):
        ops.silu_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="cos and sin"):
        ops.rope_(torch.zeros(2, 3, 8), torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="must match residual"):
        ops.add_rms_norm(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2, 8),
                         torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        ops.add_rms_norm(None, torch.zeros(2, 8), torch.ones(4), 1e-6)


def test_tiny_model_forward_with_the_kernels_matches_torch_ops(triton_layer_ops) -> None:
    """A 2-layer Qwen2-style model (Q/K/V bias, GQA) in float32: hidden states through the
    Triton layer kernels equal the torch ops' to float32 rounding."""
    from radixserve.model_executor.attention.paged_attention import AttentionMetadata
    from radixserve.model_executor.models.llama import CausalLM, ModelArgs

    a = ModelArgs(arch="Qwen2ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                  qkv_bias=True, qk_norm=False, tie_word_embeddings=True,
                  max_position_embeddings=64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    torch.manual_seed(0)
    models = []
    for ops in (None, triton_layer_ops.TritonLayerOps()):
        m = CausalLM(a, inv_freq, 1.0, 64, attention_backend="torch", layer_ops=ops)
        models.append(m)
    with torch.no_grad():
        for p in models[0].parameters():
            p.normal_(0, 0.3)
        models[1].load_state_dict(models[0].state_dict())
        for m in models:
            for layer in m.layers:
                layer.bind_dense_linears()
    assert models[1].layers[0].ops is not None and models[0].layers[0].ops is None
    page_size, t = 4, 6
    pages = torch.tensor([2, 1])  # one prompt over two pages of the pool, out of order
    pos = torch.arange(t)
    meta = AttentionMetadata(slot_mapping=pages[pos // page_size] * page_size + pos % page_size,
                             num_decodes=0, decode_page_table=None, decode_seq_lens=None,
                             decode_mask=None, prefill=[(0, t, t, pages)])
    ids = torch.randint(0, 64, (t,))
    outs = []
    for m in models:
        kv = [torch.zeros(2, 4, page_size, 2, 8) for _ in range(2)]
        outs.append(m(ids, pos, kv, meta))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
