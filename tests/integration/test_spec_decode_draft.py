"""Speculative decoding with a draft model (``{"method": "draft_model", "model": PATH}``)
through the real engine.

- A tiny random draft that often disagrees with its tiny target: greedy output and seeded
  sampled output are token for token the output without speculation, drafts are accepted and
  rejected (rolled back), ``check_integrity`` holds after every step, prefix hits on pages
  that verify steps wrote continue exactly, and a small pool preempts and stays exact (the
  draft's KV pool shares the target's page ids, so all of that is the target's bookkeeping).
- The default model as its own draft: every greedy draft is accepted (a draft decode row
  computes what the target's verify row computes), and the output, with a seeded sampled
  request beside, is the output without speculation.
- A draft whose tokenizer is not the target's is refused at start-up, naming the difference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import TINY_VOCAB, tiny_model

from radixserve import LLM, SamplingParams


def _spec(model: str, k: int = 3) -> dict:
    # null disable_by_batch_size: batched verify steps, which the CPU default leaves out;
    # fixed draft lengths: a random draft's low acceptance would make the adaptive rule stop
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k,
            "disable_by_batch_size": None, "adaptive_draft_length": False}


def _tiny_llm(path: str, spec: dict | None, **kw) -> LLM:
    args = {"seed": 0, "num_pages": 256, "page_size": 4, "max_num_batched_tokens": 24,
            "max_num_seqs": 16, "pack_weights": True}  # the batch-invariant linears
    args.update(kw)
    llm = LLM(model=path, speculative_config=spec, **args)
    llm.engine.check_integrity_each_step = True
    return llm


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]


def _counts(llm: LLM):
    s = llm.engine.get_stats().spec_decode
    assert s is not None
    return s


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A tiny Llama target and a draft of the same shapes and seed at another init scale:
    the same tokenizer, picks that agree now and then (so drafts are both accepted and
    rejected)."""
    root = Path(tmp_path_factory.mktemp("draft"))
    return tiny_model(root / "target", "llama", 0.2), tiny_model(root / "draft", "llama", 0.15)


def test_tiny_draft_output_equals_without_speculation(tiny_pair: tuple[str, str]) -> None:
    target, draft = tiny_pair
    base, spec = _tiny_llm(target, None), _tiny_llm(target, _spec(draft))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 380, int(rng.integers(3, 30))).tolist() for _ in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, logprobs=2),
              SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(temperature=1.0, seed=9, top_k=5, max_tokens=14, n=2),
              SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)]
    want = _run(base, prompts, params)
    assert _run(spec, prompts, params) == want
    c = _counts(spec)
    # not vacuous: drafts were accepted, and others rejected and rolled back
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens, c
    assert sum(c.accepted_per_pos) == c.num_accepted_tokens and len(c.accepted_per_pos) == 3
    kv = spec.engine.kv
    assert kv.num_free_pages + kv.num_cached_pages == kv.num_usable_pages

    # prefix hits on pages the verify steps (and the draft's mirror of them) wrote
    longer = [p + list(w[0][0][:len(w[0][0]) // 2]) for p, w in zip(prompts, want, strict=True)]
    plain = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * len(longer)
    hits = spec.engine.scheduler.prefix_hit_tokens
    assert _run(spec, longer, plain) == _run(base, longer, plain)
    assert spec.engine.scheduler.prefix_hit_tokens > hits


def test_small_pool_preempts_and_stays_exact(tiny_pair: tuple[str, str]) -> None:
    target, draft = tiny_pair
    small = {"num_pages": 36, "max_num_batched_tokens": 32}
    base, spec = _tiny_llm(target, None, **small), _tiny_llm(target, _spec(draft), **small)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 380, int(rng.integers(8, 30))).tolist() for _ in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    assert _run(spec, prompts, params) == _run(base, prompts, params)
    assert spec.engine.scheduler.num_preemptions > 0
    assert _counts(spec).num_accepted_tokens > 0



def test_target_with_more_embedding_rows_than_its_draft(tmp_path: Path,
                                                        tiny_pair: tuple[str, str]) -> None:
    """A target whose embedding is padded past its draft's (same tokenizer) emits ids the
    draft has no row for, and may be sent them in a prompt: the draft reads them as token 0
    (``DraftRunner.embeddable``) and the output is still the target's own."""
    _, draft = tiny_pair
    target = tiny_model(tmp_path / "padded", "llama", 0.2, vocab_size=TINY_VOCAB + 128)
    base, spec = _tiny_llm(target, None), _tiny_llm(target, _spec(draft))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 380, int(rng.integers(3, 20))).tolist() for _ in range(4)]
    prompts.append([5, TINY_VOCAB + 7, 9, TINY_VOCAB + 100, 11])  # padding ids sent in
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    want = _run(base, prompts, params)
    assert _run(spec, prompts, params) == want
    # not vacuous: the target emitted padding ids, and drafting went on around them
    assert any(t >= TINY_VOCAB for w in want for t in w[0][0])
    assert _counts(spec).num_draft_tokens > 0

def _tiny_with_tokens(path: Path, tokens: list[str]) -> str:
    """A one-layer random Llama whose word-level tokenizer has ``tokens`` (id = index)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=160,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512, eos_token_id=1, bos_token_id=0)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(tokens)}, unk_token=tokens[2]))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t, eos_token=tokens[1], bos_token=tokens[0],
                            unk_token=tokens[2]).save_pretrained(path)
    return str(path)


def test_a_draft_with_another_tokenizer_is_refused(tiny_pair: tuple[str, str],
                                                   tmp_path: Path) -> None:
    target, _ = tiny_pair
    fewer = _tiny_with_tokens(tmp_path / "fewer", [f"t{i}" for i in range(256)])
    with pytest.raises(ValueError, match=r"does not share the target's tokenizer .*: the "
                                         r"target's vocabulary has 384 tokens, the draft's 256"):
        _tiny_llm(target, _spec(fewer))
    # as many tokens, one of them another: the first differing token is named
    other = [f"t{i}" for i in range(384)]
    other[200] = "x200"
    renamed = _tiny_with_tokens(tmp_path / "renamed", other)
    with pytest.raises(ValueError, match=r"token 't200' is id 200 in the target's vocabulary "
                                         r"and None in the draft's"):
        _tiny_llm(target, _spec(renamed))


def test_special_tokens_must_match_too(tmp_path: Path) -> None:
    """The same vocabulary with another EOS token is another tokenizer (generation would
    stop elsewhere); the tokenizer is compared before any weights load."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from radixserve.model_executor.draft import check_same_tokenizer

    vocab = {f"t{i}": i for i in range(16)}
    for name, eos in (("a", "t1"), ("b", "t3")):
        PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, "t2")),
                                eos_token=eos, unk_token="t2").save_pretrained(tmp_path / name)
    check_same_tokenizer(str(tmp_path / "a"), str(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"special token eos_token is 't1' in the target's "
                                         r"tokenizer and 't3' in the draft's"):
        check_same_tokenizer(str(tmp_path / "a"), str(tmp_path / "b"))


@pytest.mark.slow
def test_default_model_as_its_own_draft() -> None:
    """Mechanics on the default model (float32, the GGUF dequantized): with itself as the
    draft every greedy draft is accepted; greedy and seeded sampled outputs are the outputs
    without speculation. Left to choose, a speculating engine takes the packed linears
    (batch invariant) rather than measuring them against dense F.linear, whose rows change
    with the batch; the reference asks for them."""
    from radixserve.model_executor.loader.default import default_model_path

    spec = LLM(dtype="float32", seed=0, quantization="none", num_pages=128,
               speculative_config=_spec(str(default_model_path()), 4))
    spec.engine.check_integrity_each_step = True
    assert spec.engine.runner.paths.paths["linear"] == "packed"
    default_llm = LLM(dtype="float32", seed=0, quantization="none", num_pages=128,
                      pack_weights=True)
    tok = spec.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
               for q in ("Name three rivers of Europe.", "What is a prime number?")]
    greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=1)
    want = default_llm.generate(prompts, greedy, use_tqdm=False)
    got = spec.generate(prompts, greedy, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
    c = _counts(spec)
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens == c.num_draft_tokens, c

    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=12)
    want = default_llm.generate(prompts[:1], sampled, use_tqdm=False)
    got = spec.generate(prompts[:1], sampled, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert _counts(spec).num_drafts > c.num_drafts
    spec.engine.shutdown()
    default_llm.engine.shutdown()
