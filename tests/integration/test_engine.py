"""Engine behaviour on the default model: sampling, stop conditions, bad input, continuous
batching, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from radixserve import LLM, SamplingParams
from radixserve.config import EngineConfig
from radixserve.engine_types import EngineRequest

pytestmark = pytest.mark.slow

QUESTIONS = ["Tell me a story about a dragon.", "What is 2+2?", "Name three colors.",
             "Write a poem about autumn leaves.", "Why is the sky blue?", "Count to ten.",
             "What do cats eat?", "Describe a sunny beach."]


def _ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


def test_seeded_sampling_is_batch_invariant(default_llm: LLM) -> None:
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=32,
                        ignore_eos=True)
    alone = default_llm.generate(QUESTIONS[0], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=40) for i in range(7)]
    batch = default_llm.generate(QUESTIONS, [sp] + others, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    again = default_llm.generate(QUESTIONS[0], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone
    other_seed = msgspec.structs.replace(sp, seed=99)
    diff = default_llm.generate(QUESTIONS[0], other_seed, use_tqdm=False)[0].outputs[0]
    assert diff.token_ids != alone  # the seed matters


def test_greedy_is_deterministic_and_sampling_varies(default_llm: LLM) -> None:
    g = SamplingParams(temperature=0.0, max_tokens=16)
    a = default_llm.generate(QUESTIONS[1], g, use_tqdm=False)[0].outputs[0]
    b = default_llm.generate(QUESTIONS[1], g, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.text == b.text
    outs = default_llm.generate(QUESTIONS[3], SamplingParams(temperature=1.5, max_tokens=24,
                                                             n=4, seed=5), use_tqdm=False)
    seqs = {tuple(c.token_ids) for c in outs[0].outputs}
    assert len(outs[0].outputs) == 4 and len(seqs) > 1


def test_stop_conditions(default_llm: LLM) -> None:
    llm = default_llm
    eos = llm.eos_token_ids[0]
    # EOS: a chat answer ends by itself with finish_reason "stop"
    o = llm.chat([{"role": "user", "content": "Say hi."}],
                 SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] == eos
    # max_tokens
    o = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=7,
                                                        ignore_eos=True), use_tqdm=False)
    c = o[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 7
    # ignore_eos keeps going past EOS
    long = llm.chat([{"role": "user", "content": "Say hi."}],
                    SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                    use_tqdm=False)[0].outputs[0]
    assert len(long.token_ids) == 60 and eos in long.token_ids
    # stop_token_ids: stop at the 3rd greedy token of the unconstrained run
    ref = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=20,
                                                          ignore_eos=True), use_tqdm=False)
    ref_ids = ref[0].outputs[0].token_ids
    stop_tok = ref_ids[2]
    first = ref_ids.index(stop_tok)
    o = llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids == ref_ids[:first + 1]
    assert o.stop_reason == stop_tok
    # min_tokens suppresses EOS and stop tokens until reached
    o = llm.chat([{"role": "user", "content": "Say hi."}],
                 SamplingParams(temperature=0, max_tokens=50, min_tokens=30),
                 use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) >= 30 and eos not in o.token_ids[:30]
    # stop strings: trimmed from the text, request ends
    text = ref[0].outputs[0].text
    word = text.split()[3]
    o = llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=20, stop=[word]), use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == word
    assert o.text == text[:text.index(word)]
    o = llm.generate("Once upon a time", SamplingParams(
        temperature=0, max_tokens=20, stop=[word], include_stop_str_in_output=True),
        use_tqdm=False)[0].outputs[0]
    assert o.text == text[:text.index(word) + len(word)]


def test_logprobs_shape(default_llm: LLM) -> None:
    o = default_llm.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert len(o.logprobs) == 5
    for tok, lp in zip(o.token_ids, o.logprobs, strict=True):
        assert tok in lp and 3 <= len(lp) <= 4
        assert max(lp.values()) == pytest.approx(lp[tok])  # greedy picks the top token
        assert all(v <= 0 for v in lp.values())


def test_penalties_change_output(default_llm: LLM) -> None:
    p = "Repeat after me: la la la la la la la la"
    base = default_llm.generate(p, SamplingParams(temperature=0, max_tokens=24,
                                                  ignore_eos=True), use_tqdm=False)
    pen = default_llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                 repetition_penalty=1.8, presence_penalty=1.5,
                                                 frequency_penalty=1.0), use_tqdm=False)
    a, b = base[0].outputs[0].token_ids, pen[0].outputs[0].token_ids
    assert a != b
    assert len(set(b)) >= len(set(a))  # penalties favour new tokens


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"), ({"logprobs": 21}, "logprobs"), ({"min_p": 2.0}, "min_p")])
def test_bad_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_engine_args(tmp_path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float8")
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(model=str(tmp_path / "does-not-exist"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported architecture|GPT2"):
        LLM(model=str(tmp_path))


def test_bad_prompts_leave_engine_clean(default_llm: LLM) -> None:
    llm = default_llm
    limit = llm.engine.max_model_len
    with pytest.raises(ValueError, match=str(limit)):
        llm.generate({"prompt_token_ids": [5] * limit}, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate({"prompt_token_ids": [10**7]}, SamplingParams(max_tokens=1))
    # a bad prompt among good ones: nothing of the call stays queued or holds pages
    with pytest.raises(ValueError):
        llm.generate(["fine", {"prompt_token_ids": [5] * limit}], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.scheduler.check_integrity()
    ok = llm.generate("still works", SamplingParams(temperature=0, max_tokens=3),
                      use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 3


def test_continuous_batching_matches_alone(default_llm: LLM) -> None:
    """Requests of different lengths and max_tokens joining while others run produce the same
    greedy tokens as when each runs alone."""
    llm = default_llm
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True) for q in QUESTIONS[:6]]
    ids = [_ids(llm, p) for p in prompts]
    max_toks = [24, 9, 17, 30, 5, 12]
    alone = []
    for x, m in zip(ids, max_toks, strict=True):
        o = llm.generate({"prompt_token_ids": x}, SamplingParams(temperature=0, max_tokens=m,
                                                                 ignore_eos=True),
                         use_tqdm=False)
        alone.append(o[0].outputs[0].token_ids)
    core = llm.engine
    got: dict[str, list[int]] = {}
    arrive_at = [0, 0, 3, 5, 8, 13]  # steps at which each request joins
    step = 0
    pending = list(range(len(ids)))
    while pending or core.has_unfinished_requests():
        for i in [i for i in pending if arrive_at[i] <= step]:
            core.add_request(EngineRequest(
                request_id=f"cb-{i}", prompt_token_ids=np.asarray(ids[i], dtype=np.int32),
                sampling_params=SamplingParams(temperature=0, max_tokens=max_toks[i],
                                               ignore_eos=True)))
            got[f"cb-{i}"] = []
            pending.remove(i)
        out = core.step()
        step += 1
        if out:
            for o in out.all_outputs():
                got[o.request_id] += o.new_token_ids
        core.scheduler.check_integrity()
    for i in range(len(ids)):
        assert got[f"cb-{i}"] == alone[i], f"request {i} differs when batched"


def test_cli_generate_json_and_errors() -> None:
    cmd = [sys.executable, "-m", "radixserve.cli", "generate", "What is 2+2?", "--chat",
           "--max-tokens", "8", "--json", "--dtype", "float32", "--num-pages", "64"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["finish_reason"] in ("stop", "length") and 1 <= len(out["token_ids"]) <= 8
    assert isinstance(out["text"], str) and out["timings"]["generate_s"] > 0
    bad = subprocess.run([sys.executable, "-m", "radixserve.cli", "generate", "x",
                          "--temperature", "-1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "temperature" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    bad = subprocess.run([sys.executable, "-m", "radixserve.cli", "generate", "x", "--model",
                          "/nonexistent/model"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "/nonexistent/model" in bad.stderr
