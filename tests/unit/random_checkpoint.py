"""A seeded random checkpoint of a ``ModelArgs``' shapes under Hugging Face names (every
layer's projections, Q/K/V biases and Q/K norms where the architecture has them, the LM head
unless tied), float32 [out_features, in_features]; for loader and sharding tests."""

from __future__ import annotations

import torch

from radixserve.model_executor.models.llama import ModelArgs


def random_checkpoint(a: ModelArgs, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, kv, h, it = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.hidden_size, \
        a.intermediate_size
    w = {"model.embed_tokens.weight": (a.vocab_size, h), "model.norm.weight": (h,)}
    if not a.tie_word_embeddings:
        w["lm_head.weight"] = (a.vocab_size, h)
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
              p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
              p + "mlp.gate_proj.weight": (it, h), p + "mlp.up_proj.weight": (it, h),
              p + "mlp.down_proj.weight": (h, it), p + "input_layernorm.weight": (h,),
              p + "post_attention_layernorm.weight": (h,)}
        if a.qkv_bias:
            w |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                  p + "self_attn.v_proj.bias": (kv,)}
        if a.qk_norm:
            w |= {p + "self_attn.q_norm.weight": (a.head_dim,),
                  p + "self_attn.k_norm.weight": (a.head_dim,)}
    return {k: torch.randn(s, generator=g) for k, s in w.items()}
