"""Tiny random-weight checkpoints (Llama, Qwen2 with Q/K/V bias, Qwen3 with qk-norm) written
with transformers, each with a word-level tokenizer so ``LLM`` loads the folder; prompts go in
as token ids."""

from __future__ import annotations

from pathlib import Path

import torch

#: vocabulary of the tiny models (ids t0..t383; t0 BOS, t1 EOS, t2 unknown)
TINY_VOCAB = 384
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


def tiny_model(tmp_path: Path, arch: str, initializer_range: float = 0.02,
               save_dtype: torch.dtype = torch.float32, vocab_size: int = TINY_VOCAB) -> str:
    """Write a 3-layer model of ``arch`` ("llama", "qwen2", "qwen3") under ``tmp_path/arch``:
    hidden 64, 4 query heads, 2 KV heads of 16, intermediate 160 (these split 1, 2 or 4 ways
    under tensor parallelism). Weights are seeded (the same every call); Qwen2 gets random
    Q/K/V biases and Qwen3 random q/k-norm weights, so those paths matter. The safetensors hold
    ``save_dtype`` (a bfloat16 checkpoint, as most are shipped, with torch.bfloat16).
    ``vocab_size`` above ``TINY_VOCAB`` pads the embedding (rows no token has, as real
    checkpoints pad theirs). Returns the folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    cfg = cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, tie_word_embeddings=arch != "llama",
              eos_token_id=1, bos_token_id=0, rms_norm_eps=1e-6,
              initializer_range=initializer_range)
    cfg.architectures = [ARCHITECTURES[arch]]
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    if arch == "qwen2":  # random biases so the Q/K/V bias path is exercised
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                         layer.self_attn.v_proj):
                proj.bias.data.normal_(0, 0.5)
    if arch == "qwen3":
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.data.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.data.uniform_(0.5, 1.5)
    path = Path(tmp_path) / arch
    model.to(save_dtype).save_pretrained(path)
    write_tokenizer_stub(str(path))
    return str(path)


def write_tokenizer_stub(path: str) -> None:
    """A tiny word-level tokenizer so ``LLM`` can load the folder (ids go in directly)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(TINY_VOCAB)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t, eos_token="t1", bos_token="t0",
                            unk_token="t2").save_pretrained(path)


def prompt_logprobs(llm, prompts: list[list[int]]) -> list[list[float]]:  # noqa: ANN001 - LLM
    """Each prompt token's logprob given the tokens before it (the first has none), from one
    ``prompt_logprobs`` request per prompt, all in one batch."""
    from radixserve import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                        use_tqdm=False)
    return [[lp[tok] for lp, tok in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:],
                                        strict=True)] for o in outs]
