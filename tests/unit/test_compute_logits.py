"""The LM head's float32 logits on CPU: a bf16 model widens them into one buffer it keeps
between steps (fresh float32 tensors past glibc's mmap threshold were fresh pages every step),
with exactly the values of ``logits.float()``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from random_checkpoint import random_checkpoint

from radixserve.model_executor.models.llama import CausalLM, ModelArgs, rope_inv_freq


def _model(dtype: torch.dtype) -> CausalLM:
    a = ModelArgs(arch="llama", vocab_size=37, hidden_size=32, intermediate_size=24,
                  num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                  qkv_bias=False, qk_norm=False, tie_word_embeddings=False,
                  max_position_embeddings=64)
    inv, scale = rope_inv_freq(None, a.head_dim)
    m = CausalLM(a, inv, scale, 64, None, "torch", None, dtype)
    m.load_weights(random_checkpoint(a).items())
    return m


def test_bf16_logits_are_widened_into_one_kept_buffer() -> None:
    m = _model(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        seen = []
        for rows in (5, 3, 5, 9, 2):
            h = torch.randn(rows, 32, generator=g).bfloat16()
            got = m.compute_logits(h)
            want = F.linear(h, m.lm_head).float()
            assert got.dtype == torch.float32 and got.shape == (rows, 37)
            assert torch.equal(got, want), rows
            seen.append(got.data_ptr())
        # one buffer while the rows fit, a larger one when they grow past it
        assert seen[0] == seen[1] == seen[2] and seen[3] == seen[4] != seen[0]


def test_float32_logits_are_the_head_output_itself() -> None:
    m = _model(torch.float32)
    with torch.inference_mode():
        h = torch.randn(4, 32)
        got = m.compute_logits(h)
        assert torch.equal(got, F.linear(h, m.lm_head))
        assert m._logits_buf is None
