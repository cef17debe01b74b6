"""Speculative decoding (n-gram) through the real engine: greedy output is token for token the
output without it, on tiny random models of three architectures and on the default model, in
the machine's default dtype (the engine is batch invariant, so a verify row computes what a
decode row computes). Every step runs ``Scheduler.check_integrity`` (pages of rejected drafts
released, nothing leaked); max_tokens, EOS and stop ids, stop strings, ignore_eos, n > 1,
logprobs, abort, preemption in a small pool, and prefix hits on pages that verify steps wrote
all give what they give without speculation. Sampled requests speculate too
(``test_spec_decode_sampled.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from spec_utils import check_abort_while_speculating, collect_tokens
from tiny_models import tiny_model

from radixserve import LLM, SamplingParams
from radixserve.core.spec_decode import DEFAULT_ROW_COST, StepCosts
from radixserve.engine_types import EngineRequest

#: null ``disable_by_batch_size``: these tests check batched verify steps, which the CPU
#: default (draft only when one request runs) would leave out; fixed draft lengths: the tiny
#: random models accept few drafts, for which the adaptive rule would draft less and less
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": None, "adaptive_draft_length": False}


def _llm(path: str | None, spec: dict | None, **kw) -> LLM:
    args = {"seed": 0, "num_pages": 256, "page_size": 4, "max_num_batched_tokens": 24,
            "max_num_seqs": 16}
    if path is not None:
        # a tiny model's shapes may measure faster dense (MKL's sgemm, whose last bits depend
        # on the row count); packed weights run radixserve's row-invariant linear kernel, the
        # batch-invariant path the default model takes, so logprobs compare bit for bit
        args["pack_weights"] = True
    args.update(kw)
    llm = LLM(model=path, speculative_config=spec, **args)
    llm.engine.check_integrity_each_step = True
    return llm


def _prompts(rng: np.random.Generator, n: int) -> list[list[int]]:
    """Prompts of 3..40 tokens; half of them repeat a short phrase (prompt lookup finds
    them), the rest random."""
    out = []
    for i in range(n):
        if i % 2:
            phrase = rng.integers(3, 380, int(rng.integers(2, 6))).tolist()
            out.append((phrase * 10)[:int(rng.integers(6, 40))])
        else:
            out.append(rng.integers(3, 380, int(rng.integers(3, 40))).tolist())
    return out


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.text)
             for c in o.outputs] for o in outs]


def _spec_counts(llm: LLM):
    s = llm.engine.get_stats().spec_decode
    assert s is not None
    return s


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[LLM, LLM]:
    path = tiny_model(Path(tmp_path_factory.mktemp("spec")), request.param, 0.2)
    return _llm(path, None), _llm(path, SPEC)


def test_greedy_output_equals_without_speculation(pair: tuple[LLM, LLM]) -> None:
    base, spec = pair
    rng = np.random.default_rng(7)
    prompts = _prompts(rng, 12)
    free = _run(base, prompts, [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
                * len(prompts))
    params = []
    for i in range(len(prompts)):
        kw: dict = {"temperature": 0, "max_tokens": 8 + 5 * i}
        if i % 3 == 0:
            kw["ignore_eos"] = True
        if i % 4 == 1:
            kw["logprobs"] = 2
        if i % 5 == 2:  # a stop id the output reaches midway
            toks = free[i][0][0]
            kw["stop_token_ids"] = [int(toks[len(toks) // 3])]
        params.append(SamplingParams(**kw))
    before = _spec_counts(spec)
    want = _run(base, prompts, params)
    got = _run(spec, prompts, params)
    assert got == want
    assert any(isinstance(w[0][2], int) for w in want)  # a stop id ended some output
    after = _spec_counts(spec)
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    drafted = after.num_draft_tokens - before.num_draft_tokens
    # not vacuous: drafts were accepted, and some were rejected and rolled back
    assert accepted > 0 and drafted > accepted, (accepted, drafted)
    assert sum(after.accepted_per_pos) == after.num_accepted_tokens
    # every request finished: each page is free or cached, none left owned by a rollback
    kv = spec.engine.kv
    assert kv.num_free_pages + kv.num_cached_pages == kv.num_usable_pages

    # prefix hits on the pages verify steps wrote: prompts extended by their outputs hit the
    # cached prompt + output pages, and must continue exactly as without speculation
    longer = [p + list(w[0][0][:len(w[0][0]) // 2]) for p, w in zip(prompts, want, strict=True)]
    params2 = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(longer)
    hits = spec.engine.scheduler.prefix_hit_tokens
    assert _run(spec, longer, params2) == _run(base, longer, params2)
    assert spec.engine.scheduler.prefix_hit_tokens > hits


def test_verify_tokens_are_decode_rows(pair: tuple[LLM, LLM]) -> None:
    """Each token of a verify request is a decode row of the attention metadata (its request's
    pages, its position + 1 keys), so a step of decodes and verifies runs in the fused decode
    stack where the runner has one; outputs stay those without speculation."""
    base, spec = pair
    runner = spec.engine.runner
    steps: list[tuple[bool, bool]] = []  # (verify step without prefill chunks, stack ran)
    real_meta = runner._metadata
    stack = runner.model.decode_stack
    ran: list[int] = []

    def metadata(batch, kernels=None):
        meta = real_meta(batch, kernels)
        if kernels is None:
            d = meta.num_decodes
            lens = meta.decode_seq_lens
            if d:
                assert lens is not None
                np.testing.assert_array_equal(lens.cpu().numpy(), batch.positions[:d] + 1)
                pages = meta.decode_page_table.cpu().numpy()
                for t in range(d):  # the request each row belongs to, by its first token
                    i = int(np.searchsorted(np.cumsum(batch.num_new), t, side="right"))
                    w = min(pages.shape[1], batch.page_table.shape[1])
                    np.testing.assert_array_equal(pages[t, :w], batch.page_table[i, :w])
            verify_only = batch.num_draft is not None and not meta.prefill
            if verify_only:
                assert d == batch.num_tokens
            steps.append((verify_only, False))
        return meta

    def run(*args, **kw):
        ran.append(1)
        if steps:
            steps[-1] = (steps[-1][0], True)
        return stack.run_unwrapped(*args, **kw)

    runner._metadata = metadata
    if stack is not None:
        stack.run_unwrapped = stack.run
        stack.run = run
    try:
        rng = np.random.default_rng(11)
        prompts = [p for p in _prompts(rng, 10) if len(p) < 20][:4]  # one chunk each
        params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * len(prompts)
        assert _run(spec, prompts, params) == _run(base, prompts, params)
    finally:
        runner._metadata = real_meta
        if stack is not None:
            stack.run = stack.run_unwrapped
            del stack.run_unwrapped
    verify_steps = [r for v, r in steps if v]
    assert verify_steps, "no step verified drafts without a prefill chunk beside them"
    if stack is not None:
        assert all(verify_steps), "a verify step did not run in the fused decode stack"


def test_stop_strings_n_and_sampled_requests(pair: tuple[LLM, LLM]) -> None:
    base, spec = pair
    rng = np.random.default_rng(3)
    prompts = _prompts(rng, 6)
    plain = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * len(prompts)
    ref = _run(base, prompts, plain)
    # a stop string from the middle of each output: the same cut with and without drafts
    params = []
    for r in ref:
        text = r[0][4]
        stop = text[len(text) // 2:len(text) // 2 + 5]
        params.append(SamplingParams(temperature=0, max_tokens=30, stop=[stop], n=2,
                                     ignore_eos=True))
    # requests that ride along in the same steps and speculate too: a seeded sampled one, a
    # penalized one, a logit_bias one and a min_tokens one; their per-row parameters must
    # land on their own rows of logits
    prompts += [prompts[1], prompts[3], prompts[1], prompts[3]]
    params += [SamplingParams(temperature=0.8, seed=11, max_tokens=20),
               SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=20),
               SamplingParams(temperature=0, logit_bias={7: 3.0, 8: -5.0}, max_tokens=20,
                              logprobs=1),
               SamplingParams(temperature=0, min_tokens=6, max_tokens=20)]
    want = _run(base, prompts, params)
    got = _run(spec, prompts, params)
    assert got == want
    assert any(w[0][1] == "stop" and w[0][2] is not None for w in want[:-4])


def test_abort_while_speculating(pair: tuple[LLM, LLM]) -> None:
    base, spec = pair
    rng = np.random.default_rng(5)
    prompts = [p for p in _prompts(rng, 8) if len(p) > 5][:4]

    check_abort_while_speculating(
        base, spec, prompts, lambda i: SamplingParams(temperature=0, max_tokens=40,
                                                      ignore_eos=True))


def test_small_pool_preempts_and_stays_exact(tmp_path: Path) -> None:
    path = tiny_model(tmp_path, "llama", 0.2)
    rng = np.random.default_rng(11)
    prompts = _prompts(rng, 10)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * len(prompts)
    small = {"num_pages": 40, "max_num_batched_tokens": 32}
    base = _llm(path, None, **small)
    spec = _llm(path, SPEC, **small)
    assert _run(spec, prompts, params) == _run(base, prompts, params)
    assert spec.engine.scheduler.num_preemptions > 0
    assert _spec_counts(spec).num_accepted_tokens > 0


def test_max_model_len_cuts_drafts_and_output_alike(tmp_path: Path) -> None:
    """Prompts near ``max_model_len`` with no ``max_tokens``: drafts never run past the
    context, and each output stops for length where it does without speculation."""
    path = tiny_model(tmp_path, "qwen3", 0.2)
    rng = np.random.default_rng(2)
    prompts = [(p * 20)[:int(rng.integers(30, 46))]
               for p in (rng.integers(3, 380, 3).tolist() for _ in range(6))]
    params = [SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)] * len(prompts)
    base = _llm(path, None, max_model_len=48)
    spec = _llm(path, SPEC, max_model_len=48)
    want = _run(base, prompts, params)
    assert _run(spec, prompts, params) == want
    assert all(len(p) + len(w[0][0]) == 48 and w[0][1] == "length"
               for p, w in zip(prompts, want, strict=True))
    assert _spec_counts(spec).num_accepted_tokens > 0


def test_no_drafts_in_batches_larger_than_disable_by_batch_size(tmp_path: Path) -> None:
    """``disable_by_batch_size`` 2: steps with more running requests draft nothing; once the
    short requests finish, the rest speculate; output as without speculation."""
    path = tiny_model(tmp_path, "llama", 0.2)
    prompts = [p for p in _prompts(np.random.default_rng(8), 12) if len(p) > 8][:4]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (4, 6, 40, 40)]
    base = _llm(path, None)
    spec = _llm(path, {**SPEC, "disable_by_batch_size": 2})
    sched = spec.engine.scheduler
    seen: list[int] = []
    draft = sched._draft

    def record(decodes, budget):  # noqa: ANN001, ANN202
        seen.append(len(sched.running))
        return draft(decodes, budget)

    sched._draft = record  # type: ignore[method-assign]
    assert _run(spec, prompts, params) == _run(base, prompts, params)
    assert seen and max(seen) <= 2
    assert _spec_counts(spec).num_drafts > 0


def test_default_cap_drafts_only_when_one_request_runs(tmp_path: Path) -> None:
    """``disable_by_batch_size`` left out, on CPU: the measured crossover, one running
    request. Steps of several requests draft nothing (the spec counters do not move); once
    the last request runs alone it drafts; output as without speculation."""
    path = tiny_model(tmp_path, "llama", 0.2)
    prompts = [p for p in _prompts(np.random.default_rng(8), 12) if len(p) > 8][:4]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (4, 6, 10, 40)]
    base = _llm(path, None)
    default = {k: v for k, v in SPEC.items() if k != "disable_by_batch_size"}
    spec = _llm(path, default)
    eng = spec.engine
    assert eng.proposer is not None and eng.proposer.disable_by_batch_size == 1
    assert _spec_counts(spec).disable_by_batch_size == 1
    toks: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(EngineRequest(request_id=str(i),
                                      prompt_token_ids=np.asarray(p, dtype=np.int32),
                                      sampling_params=sp))
    drafts_by_batch: dict[int, int] = {}
    while eng.has_unfinished_requests():
        # what the scheduler's cap compares: the requests running when the step is scheduled
        running = len(eng.scheduler.running)
        before = _spec_counts(spec).num_drafts
        out = eng.step()
        drafts_by_batch[running] = (drafts_by_batch.get(running, 0)
                                    + _spec_counts(spec).num_drafts - before)
        collect_tokens(out, toks)
    assert max(drafts_by_batch) > 1  # batched steps ran
    assert all(n == 0 for b, n in drafts_by_batch.items() if b > 1), drafts_by_batch
    assert drafts_by_batch.get(1, 0) > 0, drafts_by_batch
    want = _run(base, prompts, params)
    assert [toks[str(i)] for i in range(len(prompts))] == [w[0][0] for w in want]


@pytest.mark.slow
def test_default_model_repeating_a_paragraph() -> None:
    """The default model in its default dtype asked to repeat a paragraph: the copy is
    drafted from the prompt, and the answer is the one it gives without drafts."""
    paragraph = ("The river rises in the hills north of the town, runs south past the old "
                 "mill and the stone bridge, and reaches the sea after forty miles.")
    base = _llm(None, None, page_size=16, max_num_batched_tokens=256)
    spec = _llm(None, {"method": "ngram", "num_speculative_tokens": 4,
                       "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                       "disable_by_batch_size": None},
                page_size=16, max_num_batched_tokens=256)
    tok = base.get_tokenizer()
    msgs = [[{"role": "user", "content": f"Repeat this paragraph exactly:\n\n{paragraph}"}],
            [{"role": "user", "content": f"Copy the text below word for word.\n\n{paragraph}"}]]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=1)
    prompts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
               for m in msgs]
    want = base.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
        assert g.outputs[0].text == w.outputs[0].text
    counts = _spec_counts(spec)
    assert counts.num_accepted_tokens > 0.5 * counts.num_draft_tokens, counts


def test_server_flag_reaches_the_engine_process(tmp_path: Path) -> None:
    """``radixserve serve --speculative-config`` over the null model (it always emits one
    token, so every draft is accepted): the engine process speculates, the answer is as long
    as asked, /metrics counts drafts per position and shows the default cap (CPU: one running
    request), and no page is left behind."""
    import httpx
    from server_utils import ServerProcess, metrics_values, wait_idle

    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    srv = ServerProcess(["--null-model", "--num-pages", "256", "--speculative-config", spec],
                        tmp_path)
    try:
        srv.wait_ready()
        r = httpx.post(srv.base_url + "/v1/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "prompt": "a b a b", "max_tokens": 21, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 21
        m = metrics_values(srv.base_url)
        drafts = m["radixserve:spec_decode_num_drafts_total"]
        accepted = m["radixserve:spec_decode_num_accepted_tokens_total"]
        assert drafts > 0 and accepted == m["radixserve:spec_decode_num_draft_tokens_total"]
        # 21 tokens in fewer verify steps than tokens: several per step
        assert accepted + drafts <= 21 and drafts < 21
        assert m["radixserve:spec_decode_disable_by_batch_size"] == 1
        # /server_info names the settings in force, the cap resolved for the device
        info = httpx.get(srv.base_url + "/server_info", timeout=10).json()
        assert info["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3,
                                              "disable_by_batch_size": 1,
                                              "adaptive_draft_length": True}
        text = httpx.get(srv.base_url + "/metrics", timeout=10).text
        assert 'spec_decode_num_accepted_tokens_per_pos_total{model_name=' in text
        # bench serve reads those counters around each run: the copy set drafts, one
        # request at a time (the default cap drafts in single-stream steps only)
        import json

        from radixserve.cli import main

        out = tmp_path / "serve.json"
        assert main(["bench", "serve", "--base-url", srv.base_url, "--dataset-name", "copy",
                     "--random-input-len", "40", "--num-prompts", "2", "--disable-tqdm",
                     "--max-concurrency", "1", "--json", str(out)]) == 0
        (run,) = json.loads(out.read_text())["runs"]
        sd = run["spec_decode"]
        assert sd["num_drafts"] > 0 and sd["num_accepted_tokens"] == sd["num_draft_tokens"]
        assert sd["mean_accepted_length"] == 1 + sd["num_accepted_tokens"] / sd["num_drafts"]
        assert sd["mean_accepted_length"] > 1
        wait_idle(srv.base_url)
    finally:
        srv.stop()


def test_server_refuses_the_draft_model_method_over_the_null_model(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "serve", "--null-model", "--speculative-config",
         '{"method": "draft_model", "model": "m", "num_speculative_tokens": 3}'],
        capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "the draft_model method needs a model runner with a KV pool" in out.stderr


class _PinnedCosts(StepCosts):
    """Step costs that ignore the engine's measurements: the adaptive rule's choices then
    follow the tokens alone."""

    def observe(self, rows: int, seconds: float) -> None:
        del rows, seconds


def test_adaptive_draft_length_drafts_less_where_drafts_fail(tmp_path: Path) -> None:
    """The adaptive rule (the default) over a tiny random model, one request at a time: the
    output is the one without speculation and the engine measured its one-row and verify
    steps; at a pinned verify-row cost the requests drafted fewer tokens per verify step than
    with fixed lengths, with more of them accepted."""
    path = tiny_model(tmp_path, "llama", 0.2)
    prompts = [p for p in _prompts(np.random.default_rng(11), 16) if len(p) > 6][:6]
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)]
    base = _llm(path, None)
    single = {**SPEC, "disable_by_batch_size": 1}
    fixed = _llm(path, single)
    adaptive = _llm(path, {**single, "adaptive_draft_length": True})
    # the rule's effect at a fixed cost: measured on a tiny model, a verify row's cost follows
    # the machine's load (0.16 and 0.42 of a one-row step, two engines in one run of the
    # suite); at 0.42 the rule drafted only its one-token probes, 20 tokens, too few to
    # compare rates by, and near 0 it drafts what fixed lengths do
    pinned = _llm(path, {**single, "adaptive_draft_length": True})
    pinned.engine.proposer.costs = _PinnedCosts(one_row_s=1.0, per_row_s=DEFAULT_ROW_COST)
    assert adaptive.engine.proposer.adaptive and not fixed.engine.proposer.adaptive
    for p in prompts:  # one running request per step: the steps the costs are measured on
        want = _run(base, [p], params)
        assert _run(fixed, [p], params) == want
        assert _run(adaptive, [p], params) == want
        assert _run(pinned, [p], params) == want
    costs = adaptive.engine.proposer.costs
    assert costs.one_row_s is not None and costs.one_row_s > 0
    assert costs.per_row_s is not None
    f, a, q = _spec_counts(fixed), _spec_counts(adaptive), _spec_counts(pinned)
    # the engine's stats (and so /metrics) carry the measured cost
    assert a.verify_row_cost == costs.measured_row_cost() and a.verify_row_cost >= 0
    assert q.verify_row_cost == DEFAULT_ROW_COST
    assert a.num_drafts > 0 and q.num_drafts > 0 and f.num_accepted_tokens > 0
    # at that cost (0.25 here drafted 1.3-1.4 tokens a step against fixed lengths' 2.6-2.7,
    # and 29% of them were accepted against 10-14%, in bfloat16 and float32)
    assert q.num_draft_tokens / q.num_drafts < f.num_draft_tokens / f.num_drafts, (q, f)
    assert (q.num_accepted_tokens / q.num_draft_tokens
            > f.num_accepted_tokens / f.num_draft_tokens), (q, f)
