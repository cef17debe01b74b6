"""Speculative decoding of sampled requests (temperature > 0): rejection sampling keeps the
target's distribution exactly.

- The sampler alone: with a point-mass draft x, the draft row's token is x with probability
  p(x) (acceptance), otherwise distributed as p without x (Leviathan et al. 2023's residual),
  the bonus row follows its own p, and a seeded request draws once per output token.
- The engine, on a tiny random model: the joint distribution of a request's first four
  sampled tokens (top-k 3, so 81 outcomes) over 10,000 requests whose second and third tokens
  are verified against drafts, against the exact probabilities from the target's logprobs
  (a chi-square test; scipy's critical value when installed, else the Wilson-Hilferty one).
- The same under a grammar: unseeded requests constrained to a choice list of 4-token
  strings (top-k 3), with n-gram drafts cut to what the grammar allows, against the target's
  probabilities with the refused tokens masked out (the mask worked out from the token
  strings, not by xgrammar) and renormalised.
- A seeded sampled request's tokens with speculation are the tokens it gets without (one
  draw per output token, in order), with logprobs, stop strings, max_tokens, n > 1,
  penalties, min_tokens and abort; with drafts that are the output itself, every draft of a
  penalized or ``min_tokens`` request is accepted. ``check_integrity`` runs after every step.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from spec_utils import check_abort_while_speculating, collect_tokens
from tiny_models import TINY_VOCAB, tiny_model

from radixserve import LLM, SamplingParams
from radixserve.engine_types import EngineRequest
from radixserve.model_executor.forward_batch import SamplingBatch
from radixserve.model_executor.sampler import exponential_draws, sample
from radixserve.sampling_params import StructuredOutputsParams

#: null ``disable_by_batch_size``: batched verify steps, which the CPU default leaves out;
#: fixed draft lengths, so low-acceptance requests keep verifying drafts
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": None, "adaptive_draft_length": False}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: these tests run many tiny per-sequence kernel calls, whose thread
    team costs more than the work on a shared machine (results do not depend on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _chi2_critical(df: int, alpha: float = 1e-3) -> float:
    """The chi-square critical value at ``alpha``: scipy's when installed, else the
    Wilson-Hilferty approximation (within 1% for df >= 3 at these tails)."""
    try:
        from scipy.stats import chi2
    except ImportError:
        z = {1e-3: 3.0902, 1e-4: 3.7190}[alpha]  # upper normal quantiles
        c = 2.0 / (9.0 * df)
        return df * (1.0 - c + z * math.sqrt(c)) ** 3
    return float(chi2.ppf(1.0 - alpha, df))


def _run_to_completion(eng, toks: dict[str, list[int]]) -> None:  # noqa: ANN001
    """Step ``eng`` (an ``EngineCore``) until every request finished, appending each request's
    tokens to ``toks[request_id]``; then the KV pool is whole (every page free or cached)."""
    while eng.has_unfinished_requests():
        collect_tokens(eng.step(), toks)
    eng.scheduler.check_integrity()
    kv = eng.kv
    assert kv.num_free_pages + kv.num_cached_pages == kv.num_usable_pages


def _outcome_counts(toks: dict[str, list[int]], cells: list[tuple[int, ...]]) -> np.ndarray:
    """How many requests gave each outcome of ``cells`` (int64 [len(cells)]); every request's
    tokens must be one of them (an outcome the target cannot give fails the test)."""
    index = {c: j for j, c in enumerate(cells)}
    outside = [t for t in toks.values() if tuple(t) not in index]
    assert not outside, outside[:5]
    counts = np.zeros(len(cells), dtype=np.int64)
    for t in toks.values():
        counts[index[tuple(t)]] += 1
    return counts


def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """Pearson's statistic of ``counts`` (int [C]) against ``probs`` (float [C], summing to
    1) and its critical value; every expected count must be at least 5."""
    n = counts.sum()
    expected = n * probs
    assert expected.min() >= 5, expected.min()
    stat = float(((counts - expected) ** 2 / expected).sum())
    return stat, _chi2_critical(len(probs) - 1)


def _pool_rare(counts: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``counts`` and ``probs`` with the outcomes expected fewer than 5 times pooled into one
    (with the next rarest ones while the pool is expected fewer than 5 times)."""
    n = counts.sum()
    order = np.argsort(probs)
    m = int((probs * n < 5).sum())
    while m and probs[order[:m]].sum() * n < 5:
        m += 1
    rare, keep = order[:m], order[m:]
    if not m:
        return counts, probs
    return (np.append(counts[keep], counts[rare].sum()),
            np.append(probs[keep], probs[rare].sum()))


def _probs(logits: torch.Tensor, temperature: float, top_k: int) -> np.ndarray:
    """The target's processed distribution of one row (temperature then top-k)."""
    p = torch.softmax(logits / temperature, dim=-1)
    keep = p.argsort(descending=True)[:top_k]
    out = torch.zeros_like(p)
    out[keep] = p[keep]
    return (out / out.sum()).numpy().astype(np.float64)


@pytest.mark.parametrize("seeded", [False, True])
def test_sampler_accepts_with_p_of_the_draft_and_rejects_to_the_residual(seeded: bool
                                                                          ) -> None:
    vocab, temp, top_k, n = 8, 0.9, 5, 12_000
    gen = torch.Generator().manual_seed(3)
    row0 = torch.randn(vocab, generator=gen) * 1.5
    row1 = torch.randn(vocab, generator=gen) * 1.5
    p0, p1 = _probs(row0, temp, top_k), _probs(row1, temp, top_k)
    draft = int(np.argsort(p0)[-2])  # the second likeliest: accepted about a third of the time
    logits = torch.stack([row0, row1]).repeat(n, 1)
    sp = SamplingBatch(temperature=np.full(2 * n, temp, np.float32),
                       top_k=np.full(2 * n, top_k, np.int64),
                       top_p=np.ones(2 * n, np.float32), min_p=np.zeros(2 * n, np.float32),
                       greedy=np.zeros(2 * n, bool),
                       draft_tokens=np.tile(np.asarray([draft, -1], np.int64), n))
    if seeded:
        sp.generators = [g for i in range(n) for g in [torch.Generator().manual_seed(i)] * 2]
    tokens = sample(logits, sp, torch.Generator().manual_seed(0)).token_ids.reshape(n, 2)
    accepted = tokens[:, 0] == draft
    # acceptance with probability p(draft): within 4 standard deviations of the binomial
    a, pa = int(accepted.sum()), p0[draft]
    assert abs(a - n * pa) < 4 * math.sqrt(n * pa * (1 - pa)), (a, n * pa)
    # a rejected row's token follows the residual: p without the draft, renormalised
    resid = p0.copy()
    resid[draft] = 0
    resid /= resid.sum()
    support = resid > 0
    rejected = np.bincount(tokens[~accepted, 0], minlength=vocab)
    assert rejected[~support].sum() == 0
    stat, crit = _chi2_ok(rejected[support], resid[support])
    assert stat < crit, (stat, crit)
    # the bonus row, used after an acceptance, follows its own p
    bonus = np.bincount(tokens[accepted, 1], minlength=vocab)
    stat, crit = _chi2_ok(bonus[p1 > 0], p1[p1 > 0])
    assert stat < crit, (stat, crit)
    if seeded:
        # one draw per output token: a rejected request drew once, an accepted one twice
        for i in (int(np.flatnonzero(accepted)[0]), int(np.flatnonzero(~accepted)[0])):
            g = torch.Generator().manual_seed(i)
            for _ in range(2 if accepted[i] else 1):
                exponential_draws(torch.empty(vocab), g)
            assert torch.equal(g.get_state(), sp.generators[2 * i].get_state())


def _llm(path: str, spec: dict | None, **kw) -> LLM:
    args = {"seed": 0, "num_pages": 256, "page_size": 4, "max_num_batched_tokens": 24,
            "max_num_seqs": 16, "pack_weights": True}  # the batch-invariant linear path
    args.update(kw)
    llm = LLM(model=path, speculative_config=spec, **args)
    llm.engine.check_integrity_each_step = True
    return llm


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(Path(tmp_path_factory.mktemp("spec_sampled")), "qwen3", 0.2)


class _TableProposer:
    """Drafts looked up by context (the test's stand-in for the n-gram proposer, so each
    verified position has a draft that is accepted about as often as it is rejected)."""

    def __init__(self, k: int, table: dict[tuple[int, ...], list[int]]) -> None:
        from radixserve.core.spec_decode import StepCosts

        self.k = k
        self.table = table
        self.costs = StepCosts()  # measured by the engine, unused: lengths are fixed

    def active(self, batch_size: int) -> bool:
        return True

    def draft_length(self, req: object) -> int:
        return self.k

    def propose(self, tokens: np.ndarray, most: int) -> np.ndarray:
        return np.asarray(self.table.get(tuple(tokens.tolist()), [])[:most], dtype=np.int32)


def test_engine_samples_the_targets_joint_distribution(model_path: str) -> None:
    prompt, temp, top_k, n = [5, 6, 7, 8, 9, 10], 1.3, 3, 10_000
    big = {"num_pages": 8192, "max_num_seqs": 1024, "max_num_batched_tokens": 8192}
    base = _llm(model_path, None, **big)
    base.engine.check_integrity_each_step = False

    def dist(contexts: list[list[int]]) -> list[dict[int, float]]:
        """The processed next-token distribution after each context: top-k of the raw
        logprobs, softmax at the temperature (a shift of the logits changes nothing)."""
        outs = base.generate([{"prompt_token_ids": c} for c in contexts],
                             SamplingParams(temperature=0, max_tokens=1, logprobs=top_k),
                             use_tqdm=False)
        res = []
        for o in outs:
            top = sorted(o.outputs[0].logprobs[0].items(), key=lambda kv: -kv[1])[:top_k]
            w = np.exp(np.asarray([v for _, v in top]) / temp)
            res.append({t: float(x) for (t, _), x in zip(top, w / w.sum(), strict=True)})
        return res

    # exact probabilities of every 4-token outcome, level by level
    exact: dict[tuple[int, ...], float] = {(): 1.0}
    nxt: dict[tuple[int, ...], dict[int, float]] = {}
    for _ in range(4):
        ctxs = list(exact)
        for c, d in zip(ctxs, dist([prompt + list(c) for c in ctxs]), strict=True):
            nxt[c] = d
        exact = {c + (t,): pc * pt for c, pc in exact.items() for t, pt in nxt[c].items()}
    # drafts after the first token: its second likeliest successor (rejected often), then
    # that one's likeliest successor
    table = {}
    for t1 in nxt[()]:
        d2 = sorted(nxt[(t1,)], key=nxt[(t1,)].get)[-2]
        d3 = max(nxt[(t1, d2)], key=nxt[(t1, d2)].get)
        table[tuple(prompt) + (t1,)] = [d2, d3]

    spec = _llm(model_path, {**SPEC, "num_speculative_tokens": 2}, **big)
    # 10,000 requests: the pool's integrity is checked once, at the end
    spec.engine.check_integrity_each_step = False
    proposer = _TableProposer(2, table)
    spec.engine.scheduler.proposer = proposer  # type: ignore[assignment]
    eng = spec.engine
    toks: dict[str, list[int]] = {}
    for i in range(n):
        # half seeded (each its own stream, drawn row by row), half from the engine's stream
        sp = SamplingParams(temperature=temp, top_k=top_k, max_tokens=4, ignore_eos=True,
                            seed=i if i % 2 else None)
        toks[str(i)] = []
        eng.add_request(EngineRequest(request_id=str(i),
                                      prompt_token_ids=np.asarray(prompt, dtype=np.int32),
                                      sampling_params=sp))
    _run_to_completion(eng, toks)
    cells = sorted(exact)
    counts = _outcome_counts(toks, cells)
    stat, crit = _chi2_ok(counts, np.asarray([exact[c] for c in cells]))
    assert stat < crit, (stat, crit)
    # not vacuous: every request verified two drafts; both positions accepted and rejected
    c = eng.get_stats().spec_decode
    assert c is not None and c.num_drafts == n and c.num_draft_tokens == 2 * n
    assert 0.15 * n < c.accepted_per_pos[0] < 0.6 * n, c
    assert 0 < c.accepted_per_pos[1] < c.accepted_per_pos[0], c


class _CountingProposer:
    """The engine's proposer, counting the draft tokens it proposes (before the scheduler
    cuts a constrained request's draft at the first token its grammar refuses)."""

    def __init__(self, inner) -> None:  # noqa: ANN001 - the engine's NgramProposer
        self.inner = inner
        self.k = inner.k
        self.costs = inner.costs
        self.proposed = 0

    def active(self, batch_size: int) -> bool:
        return self.inner.active(batch_size)

    def draft_length(self, req) -> int:  # noqa: ANN001 - a core Request
        return self.inner.draft_length(req)

    def propose(self, tokens: np.ndarray, most: int) -> np.ndarray:
        d = self.inner.propose(tokens, most)
        self.proposed += int(d.shape[0])
        return d


def test_engine_samples_the_constrained_targets_joint_distribution(model_path: str) -> None:
    """Unseeded sampled requests under a grammar, with n-gram drafts cut to what it allows,
    verified against rows masked with its state after the drafts before them: the joint
    distribution of the first four tokens is the target's with the grammar's refused tokens
    masked out, then top-k, renormalised (a chi-square test, as above)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # The grammar is a choice list of 4-token strings over t3..t9 (one digit each, so no
    # other token's text, such as t38's, continues a prefix of a choice): after each prefix,
    # the 3 of them the target finds likeliest there and the least likely (0.2% to 7% of its
    # mass: the mask decides nearly every pick); top-k 3 drops the last (by 0.86 nats or
    # more), so the filter must see masked probabilities. The prompt repeats a phrase of
    # t3..t9 and t50, so prompt lookup drafts from it; drafts are cut where the grammar
    # refuses a token (t50, or a digit it does not allow after the prefix), and what is left
    # is verified.
    phrase, top_k, n = [6, 4, 9, 50, 7, 8, 3, 5], 3, 10_000
    prompt = phrase * 2
    # the target's logprobs from transformers' model of the checkpoint (a batch of contexts
    # in one forward, where the engine's whole-vocabulary prompt logprobs take seconds; they
    # agree within 1e-5) and the token strings from its tokenizer
    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    strings = AutoTokenizer.from_pretrained(model_path).convert_ids_to_tokens(
        list(range(TINY_VOCAB)))

    def logprobs(contexts: list[tuple[int, ...]]) -> np.ndarray:
        """float64 [len(contexts), V]: the raw next-token logprobs after each context."""
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + list(c) for c in contexts])).logits[:, -1]
        return torch.log_softmax(logits.double(), dim=-1).numpy()

    lps: dict[tuple[int, ...], np.ndarray] = {}
    level: list[tuple[int, ...]] = [()]
    for _ in range(4):
        nxt = []
        for c, lp in zip(level, logprobs(level), strict=True):
            lps[c] = lp
            ranked = sorted(range(3, 10), key=lp.__getitem__, reverse=True)
            nxt += [c + (t,) for t in ranked[:3] + ranked[-1:]]
        level = nxt
    choices = ["".join(strings[t] for t in c) for c in level]
    # the mask from the choice strings and the token strings alone (not xgrammar's): a token
    # is allowed when the text so far followed by its text begins some choice
    prefixes = {w[:i] for w in choices for i in range(len(w) + 1)}

    def dist(c: tuple[int, ...]) -> dict[int, float]:
        text = "".join(strings[t] for t in c)
        allowed = [t for t in range(TINY_VOCAB) if text + strings[t] in prefixes]
        kept = sorted(allowed, key=lambda t: -lps[c][t])[:top_k]
        w = np.exp(lps[c][kept] - lps[c][kept].max())  # temperature 1
        return dict(zip(kept, w / w.sum(), strict=True))

    exact: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(4):
        exact = {c + (t,): pc * pt for c, pc in exact.items() for t, pt in dist(c).items()}

    big = {"num_pages": 8192, "max_num_seqs": 1024, "max_num_batched_tokens": 8192}
    spec = _llm(model_path, {**SPEC, "num_speculative_tokens": 2}, **big)
    spec.engine.check_integrity_each_step = False  # checked once, at the end
    eng = spec.engine
    proposer = _CountingProposer(eng.scheduler.proposer)
    eng.scheduler.proposer = proposer  # type: ignore[assignment]
    sp = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=4,
                        structured_outputs=StructuredOutputsParams(choice=choices))
    toks: dict[str, list[int]] = {}
    for i in range(n):
        toks[str(i)] = []
        eng.add_request(EngineRequest(request_id=str(i),
                                      prompt_token_ids=np.asarray(prompt, dtype=np.int32),
                                      sampling_params=sp))
    _run_to_completion(eng, toks)
    cells = sorted(exact)
    counts = _outcome_counts(toks, cells)
    stat, crit = _chi2_ok(*_pool_rare(counts, np.asarray([exact[c] for c in cells])))
    assert stat < crit, (stat, crit)
    # not vacuous: drafts were proposed, some cut by the grammar, and those verified were
    # accepted and rejected at both draft positions (a verify step has 1 or 2 drafts, so
    # num_draft_tokens - num_drafts steps verified a second one)
    c = eng.get_stats().spec_decode
    assert c is not None and c.num_drafts > 0.5 * n, c
    assert c.num_draft_tokens < 0.8 * proposer.proposed, (c, proposer.proposed)
    assert 0.1 * c.num_drafts < c.accepted_per_pos[0] < 0.9 * c.num_drafts, c
    second = c.num_draft_tokens - c.num_drafts
    assert 0.05 * second < c.accepted_per_pos[1] < 0.9 * second, c


def _prompts(rng: np.random.Generator, n: int) -> list[list[int]]:
    """Prompts that repeat a short phrase (prompt lookup drafts from them)."""
    out = []
    for _ in range(n):
        phrase = rng.integers(3, 380, int(rng.integers(2, 5))).tolist()
        out.append((phrase * 10)[:int(rng.integers(8, 30))])
    return out


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.text)
             for c in o.outputs] for o in outs]


def test_seeded_sampled_output_equals_without_speculation(model_path: str) -> None:
    base, spec = _llm(model_path, None), _llm(model_path, SPEC)
    rng = np.random.default_rng(4)
    prompts = _prompts(rng, 10)
    # low temperatures: the model's picks follow the repeated phrase often enough for drafts
    # to be accepted; a stop string cut from the middle of an output
    probe = _run(base, prompts, [SamplingParams(temperature=0.3, seed=1, max_tokens=24,
                                                ignore_eos=True)] * len(prompts))
    params = []
    for i in range(len(prompts)):
        kw: dict = {"temperature": (0.2, 0.5, 1.0)[i % 3], "seed": 100 + i,
                    "max_tokens": 10 + 3 * i, "top_k": (0, 20)[i % 2]}
        if i % 4 == 0:
            kw["ignore_eos"] = True
        if i % 3 == 1:
            kw["logprobs"] = 2
        if i == 2:
            text = probe[i][0][4]
            kw.update(stop=[text[len(text) // 2:len(text) // 2 + 5]], seed=1, temperature=0.3,
                      max_tokens=24, ignore_eos=True)
        if i == 5:
            kw.update(n=3)  # children get seeds seed, seed + 1, ...
        if i == 6:
            kw.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
        if i == 7:
            kw.update(min_tokens=8, top_p=0.9)
        params.append(SamplingParams(**kw))
    before = spec.engine.get_stats().spec_decode
    assert before is not None
    want = _run(base, prompts, params)
    got = _run(spec, prompts, params)
    assert got == want
    assert want[2][0][1] == "stop" and want[2][0][2] is not None  # the stop string cut it
    assert len(want[5]) == 3
    after = spec.engine.get_stats().spec_decode
    assert after is not None
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    drafted = after.num_draft_tokens - before.num_draft_tokens
    assert 0 < accepted < drafted, (accepted, drafted)


def test_penalties_and_min_tokens_see_earlier_drafts(model_path: str) -> None:
    """Drafts that are the output itself (an oracle proposer built from the run without
    speculation): every draft must be accepted, which holds only if each verify row's
    penalties count the drafts before it as generated and its ``min_tokens`` mask counts
    them too."""
    base = _llm(model_path, None)
    prompts = _prompts(np.random.default_rng(6), 6)
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=24, ignore_eos=True,
                             presence_penalty=0.8, frequency_penalty=0.5,
                             repetition_penalty=1.3, logprobs=1) for i in range(3)]
    # EOS (id 1) made the likeliest token by far (on every CPU kind and dtype), and blocked
    # until the 10th token: each request stops right after its min_tokens
    params += [SamplingParams(temperature=0.7, seed=i, max_tokens=24, min_tokens=10,
                              logit_bias={1: 8.0}) for i in range(3)]
    want = _run(base, prompts, params)
    assert all(w[0][1] == "stop" and len(w[0][0]) >= 10 for w in want[3:])
    table = {}
    for p, w in zip(prompts, want, strict=True):
        out = list(w[0][0])
        for m in range(1, len(out)):
            table[tuple(p + out[:m])] = out[m:]
    spec = _llm(model_path, SPEC)
    spec.engine.scheduler.proposer = _TableProposer(3, table)  # type: ignore[assignment]
    assert _run(spec, prompts, params) == want
    c = spec.engine.get_stats().spec_decode
    assert c is not None and c.num_draft_tokens > 40
    assert c.num_accepted_tokens == c.num_draft_tokens, c


def test_abort_while_speculating_sampled(model_path: str) -> None:
    base, spec = _llm(model_path, None), _llm(model_path, SPEC)
    prompts = _prompts(np.random.default_rng(9), 4)

    check_abort_while_speculating(
        base, spec, prompts, lambda i: SamplingParams(temperature=0.3, seed=i, max_tokens=40,
                                                      ignore_eos=True))
    counts = spec.engine.get_stats().spec_decode
    assert counts is not None and counts.num_accepted_tokens > 0
