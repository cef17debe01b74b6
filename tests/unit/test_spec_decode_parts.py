"""Speculative decoding's parts without a model: the n-gram proposer against a brute-force
reading of vLLM's semantics, greedy acceptance, ``--speculative-config`` validation, the
acceptance counters and their metrics, and the output processor given several tokens in one
step (the stop string ends the output where it ended without speculation)."""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest

from radixserve.config import EngineConfig, SpeculativeConfig
from radixserve.core.spec_decode import SpecDecodeStats, accepted_length, propose_ngram
from radixserve.engine_types import SchedulerStats, SpecDecodeCounts, StepOutputs, TokenOutput
from radixserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from radixserve.frontend.output_processor import OutputProcessor
from radixserve.metrics import ServerMetrics
from radixserve.sampling_params import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _brute(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix n-gram, its earliest earlier occurrence, the k tokens after it."""
    total = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= total:
            continue
        suffix = tokens[total - n:]
        for s in range(0, total - n):  # occurrences that are not the suffix itself
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def _propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return propose_ngram(np.asarray(tokens, dtype=np.int32), min_n, max_n, k).tolist()


def test_vllm_docstring_example() -> None:
    # vLLM's NgramProposer.propose docstring: [4,2,3] has no match, [2,3] does
    assert _propose([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]


def test_longest_ngram_wins_then_its_earliest_occurrence() -> None:
    # [2,3] occurs first at 0 (followed by 7), but the 3-gram [1,2,3] at 3 is longer
    assert _propose([2, 3, 7, 1, 2, 3, 8, 1, 2, 3], 1, 3, 3) == [8, 1, 2]
    # two occurrences of the 2-gram: the earliest one's continuation
    assert _propose([5, 6, 1, 7, 5, 6, 2, 9, 5, 6], 2, 2, 2) == [1, 7]
    # an occurrence overlapping the suffix counts (a run of one token)
    assert _propose([4, 4, 4, 4], 2, 3, 5) == [4]


def test_nothing_proposed_below_min_n_or_without_room() -> None:
    assert _propose([1, 2, 3, 9, 3], 2, 4, 3) == []  # only a 1-gram recurs
    assert _propose([1, 2, 3, 9, 3], 1, 4, 3) == [9, 3]
    assert _propose([1, 2, 1, 2], 1, 2, 0) == []
    assert _propose([7], 1, 1, 3) == []


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_match_the_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        vocab = int(rng.integers(2, 6))
        toks = rng.integers(0, vocab, n).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        assert _propose(toks, lo, hi, k) == _brute(toks, lo, hi, k), (toks, lo, hi, k)


def test_greedy_acceptance() -> None:
    d = np.array([5, 6, 7])
    assert accepted_length(d, np.array([5, 6, 7, 8])) == 3  # all, then the bonus token
    assert accepted_length(d, np.array([5, 9, 7, 8])) == 1
    assert accepted_length(d, np.array([1, 6, 7, 8])) == 0
    assert accepted_length(np.array([4]), np.array([4, 2])) == 1


def test_acceptance_counters() -> None:
    st = SpecDecodeStats()
    st.observe(3, 2)
    st.observe(2, 0)
    st.observe(3, 3)
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (3, 8, 5)
    assert st.accepted_per_pos == [2, 2, 1]
    assert st.mean_accepted_length == pytest.approx(1 + 5 / 3)


# ----------------------------------------------------------------------------- config
def test_config_defaults_and_vllm_lookup_bounds() -> None:
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 5, 5)
    c = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_min": 2,
                                 "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 4)
    cfg = EngineConfig(speculative_config='{"num_speculative_tokens": 3}')
    assert isinstance(cfg.speculative_config, SpeculativeConfig)


@pytest.mark.parametrize(("value", "field"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 2.5}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "lookahead": 3}, "unknown field 'lookahead'"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "speculative_config.disable_by_batch_size"),
    ("{not json", "not valid JSON"),
    ("[1]", "must be a JSON object"),
])
def test_bad_configs_name_the_field(value: object, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SpeculativeConfig.parse(value)  # type: ignore[arg-type]


def test_draft_model_fields() -> None:
    c = SpeculativeConfig.parse({"method": "draft_model", "model": "x",
                                 "num_speculative_tokens": 3})
    assert (c.model, c.num_speculative_tokens, c.prompt_lookup_min) == ("x", 3, None)
    with pytest.raises(ValueError, match=r"speculative_config\.model=None must name the draft"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=r"speculative_config\.prompt_lookup_max=2 belongs to "
                                         r"the ngram method"):
        SpeculativeConfig.parse({"method": "draft_model", "model": "x",
                                 "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match=r"speculative_config\.model='x' is for the "
                                         r"draft_model method"):
        SpeculativeConfig.parse({"method": "ngram", "model": "x", "num_speculative_tokens": 3})
    spec = {"method": "draft_model", "model": "x", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="draft_model method is not supported with "
                                         "tensor_parallel_size > 1 or kv_transfer_config"):
        EngineConfig(speculative_config=spec, tensor_parallel_size=2)


def test_overlap_is_refused_with_speculation() -> None:
    with pytest.raises(ValueError, match="disable_overlap=False"):
        EngineConfig(speculative_config={"num_speculative_tokens": 2}, disable_overlap=False)
    EngineConfig(speculative_config={"num_speculative_tokens": 2}, disable_overlap=True)


def test_cli_flag() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": '
                       '3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'])
    cfg = engine_config_from_args(ns)
    assert cfg.speculative_config == SpeculativeConfig("ngram", 3, 2, 4)
    assert engine_config_from_args(p.parse_args([])).speculative_config is None
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", '{"method": "draft_model", '
                      '"num_speculative_tokens": 3}'])


# ----------------------------------------------------------------------------- metrics
def test_metrics_count_growth_per_position() -> None:
    m = ServerMetrics(model_name="m")
    m.update_from_stats(SchedulerStats(spec_decode=SpecDecodeCounts(
        num_drafts=4, num_draft_tokens=12, num_accepted_tokens=7, accepted_per_pos=[4, 2, 1])))
    m.update_from_stats(SchedulerStats(spec_decode=SpecDecodeCounts(
        num_drafts=5, num_draft_tokens=15, num_accepted_tokens=8, accepted_per_pos=[5, 2, 1],
        disable_by_batch_size=1, verify_row_cost=0.25)))
    text = m.render()[0].decode()
    assert 'radixserve:spec_decode_disable_by_batch_size{model_name="m"} 1.0' in text
    assert 'radixserve:spec_decode_verify_row_cost{model_name="m"} 0.25' in text
    assert 'radixserve:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'radixserve:spec_decode_num_draft_tokens_total{model_name="m"} 15.0' in text
    assert 'radixserve:spec_decode_num_accepted_tokens_total{model_name="m"} 8.0' in text
    assert ('radixserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",'
            'position="0"} 5.0') in text
    assert ('radixserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",'
            'position="2"} 1.0') in text


# ----------------------------------------------------------------------------- frontend
def test_several_tokens_in_one_step_stop_where_one_at_a_time_would(tok) -> None:
    prompt = tok.encode("List:", add_special_tokens=False)
    gen = tok.encode(" apples, pears and plums", add_special_tokens=False)
    rows = [[[t, -0.5]] for t in gen]
    proc = OutputProcessor(tok)
    st = proc.add_request("s", prompt, SamplingParams(stop=["pears"], logprobs=0), 0.0)
    out = proc.process(StepOutputs(step=1, outputs=[TokenOutput(
        request_id="s", new_token_ids=gen, num_prompt_tokens=len(prompt), logprobs=rows)]))
    assert out.abort_ids == ["s"]
    (d,) = out.deltas
    assert d.finish_reason == "stop" and st.text == " apples, "
    # the tokens after the one that completed "pears", and their logprob rows, are dropped
    one = OutputProcessor(tok)
    ref = one.add_request("s", prompt, SamplingParams(stop=["pears"], logprobs=0), 0.0)
    for i, t in enumerate(gen):
        one.process(StepOutputs(step=i + 1, outputs=[TokenOutput(
            request_id="s", new_token_ids=[t], num_prompt_tokens=len(prompt),
            logprobs=[rows[i]])]))
        if ref.finished:
            break
    assert st.token_ids == ref.token_ids and len(st.token_ids) < len(gen)
    assert st.logprob_rows == ref.logprob_rows and len(st.logprob_rows) == len(st.token_ids)


def test_bench_summary_is_the_run_between_two_snapshots() -> None:
    from radixserve.bench.offline import spec_decode_summary

    before = SpecDecodeCounts(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3,
                              accepted_per_pos=[2, 1, 0])
    after = SpecDecodeCounts(num_drafts=6, num_draft_tokens=18, num_accepted_tokens=11,
                             accepted_per_pos=[6, 4, 1])
    s = spec_decode_summary(before, after)
    assert (s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"]) == (4, 12, 8)
    assert s["acceptance_rate"] == pytest.approx(8 / 12)
    assert s["mean_accepted_length"] == pytest.approx(3.0)
    assert s["acceptance_rate_per_pos"] == pytest.approx([1.0, 0.75, 0.25])


def test_disable_by_batch_size() -> None:
    from radixserve.core.spec_decode import NgramProposer

    capped = NgramProposer(SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=4),
                           "cpu")
    assert capped.active(1) and capped.active(4) and not capped.active(5)
    never = SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=None)
    assert NgramProposer(never, "cpu").active(10_000)


def test_absent_disable_by_batch_size_takes_the_devices_crossover() -> None:
    """Left out, the cap is the device's measured rule (one running request on CPU and on
    CUDA); an explicit JSON null keeps vLLM's "never"; an integer is kept."""
    from radixserve.config import SPEC_BATCH_AUTO
    from radixserve.core.spec_decode import (
        NgramProposer,
        crossover_batch_size,
        effective_disable_by_batch_size,
    )

    absent = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert absent.disable_by_batch_size == SPEC_BATCH_AUTO
    assert effective_disable_by_batch_size(absent, "cpu") == crossover_batch_size("cpu", 4) == 1
    assert effective_disable_by_batch_size(absent, "cuda") == crossover_batch_size("cuda", 4)
    assert crossover_batch_size("cuda", 4) == crossover_batch_size("cuda", 200) == 1
    proposer = NgramProposer(absent, "cpu")
    assert proposer.disable_by_batch_size == 1
    assert proposer.active(1) and not proposer.active(2)
    explicit_auto = SpeculativeConfig.parse('{"num_speculative_tokens": 4, '
                                            '"disable_by_batch_size": "auto"}')
    assert explicit_auto == absent

    null = SpeculativeConfig.parse('{"num_speculative_tokens": 4, "disable_by_batch_size": null}')
    assert null.disable_by_batch_size is None
    for device in ("cpu", "cuda"):
        assert effective_disable_by_batch_size(null, device) is None
    assert NgramProposer(null, "cpu").active(10_000)

    given = SpeculativeConfig.parse('{"num_speculative_tokens": 4, "disable_by_batch_size": 8}')
    for device in ("cpu", "cuda"):
        assert effective_disable_by_batch_size(given, device) == 8

    with pytest.raises(ValueError, match=r"disable_by_batch_size='fast' must be an integer "
                                         r'>= 1, null or "auto"'):
        SpeculativeConfig.parse({"num_speculative_tokens": 4, "disable_by_batch_size": "fast"})


def test_absent_and_null_survive_the_engine_process_json() -> None:
    """The frontend hands the engine process its config as JSON (``dataclasses.asdict``):
    a left-out cap and an explicit null must stay apart there."""
    import dataclasses
    import json

    for value in ({}, {"disable_by_batch_size": None}, {"disable_by_batch_size": 3}):
        cfg = EngineConfig(speculative_config={"num_speculative_tokens": 2, **value})
        back = EngineConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
        assert back.speculative_config == cfg.speculative_config


def test_draft_length_follows_the_requests_acceptance() -> None:
    """The adaptive rule drafts up to k for a request whose drafts are accepted, none for one
    whose first tokens are rejected (then one token every ``PROBE_EVERY`` steps), and
    something in between for a request whose drafts go wrong after the first token or two."""
    from radixserve.core.request import DraftAcceptance
    from radixserve.core.spec_decode import (
        PROBE_EVERY,
        StepCosts,
        choose_draft_length,
        record_verify,
    )

    costs = StepCosts()  # the default cost per row until measured
    fresh = choose_draft_length(DraftAcceptance(), 8, costs)
    assert 1 <= fresh < 8  # the prior: worth a short draft, not a full one

    copying = DraftAcceptance()
    for _ in range(6):
        record_verify(copying, 8, 8)
    assert choose_draft_length(copying, 8, costs) == 8
    assert choose_draft_length(copying, 3, costs) == 3

    wrong = DraftAcceptance()
    for _ in range(6):
        record_verify(wrong, 4, 0)
    got = [choose_draft_length(wrong, 8, costs) for _ in range(2 * PROBE_EVERY)]
    assert got == ([0] * (PROBE_EVERY - 1) + [1]) * 2
    # accepted again: the record follows (older outcomes decay)
    for _ in range(8):
        record_verify(wrong, 1, 1)
    assert choose_draft_length(wrong, 8, costs) >= 1

    chat = DraftAcceptance()  # first token half the time, then about one more
    for i in range(20):
        record_verify(chat, 6, 0 if i % 2 else 2)
    assert 1 <= choose_draft_length(chat, 8, costs) <= 3


def test_draft_length_shrinks_as_verify_rows_cost_more() -> None:
    """The same record drafts less where a verify row costs more against a one-row step, and
    not at all where a row costs as much as a step (CUDA's eager verify against a graphed
    decode measured 1.7 one-row steps per row: docs/benchmarks.md)."""
    from radixserve.core.request import DraftAcceptance
    from radixserve.core.spec_decode import StepCosts, choose_draft_length, record_verify

    rec = DraftAcceptance()
    for i in range(10):
        record_verify(rec, 8, (4, 8, 6, 2, 8)[i % 5])

    def with_row_cost(rel: float) -> int:
        costs = StepCosts(one_row_s=0.005, per_row_s=0.005 * rel)
        return choose_draft_length(DraftAcceptance(**{f: getattr(rec, f) for f in (
            "first_accepted", "first_rejected", "accepted", "rejected")}), 8, costs)

    lengths = [with_row_cost(rel) for rel in (0.02, 0.15, 0.4, 0.8)]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] == 8 and lengths[-1] < 8
    assert lengths[0] > lengths[-1] > 0
    assert with_row_cost(1.7) == 0


def test_step_costs_take_medians() -> None:
    """One-row steps and what each verify row adds, as medians: a stalled step moves
    neither; the rows' cost is counted from the one-row step's."""
    from radixserve.core.spec_decode import DEFAULT_ROW_COST, StepCosts

    c = StepCosts()
    assert c.relative(1) == 1.0 and c.relative(5) == pytest.approx(1 + 4 * DEFAULT_ROW_COST)
    assert c.measured_row_cost() is None
    c.observe(5, 0.009)  # a verify before any one-row step: nothing to count it from
    assert c.per_row_s is None
    for s in (0.005, 0.005, 0.050, 0.005, 0.0051):
        c.observe(1, s)
    assert c.one_row_s == pytest.approx(0.005)
    for s in (0.009, 0.0088, 0.2, 0.0092):
        c.observe(5, s)
    assert c.per_row_s == pytest.approx(0.001, rel=0.03)
    assert c.relative(5) == pytest.approx(1.8, rel=0.02)
    assert c.measured_row_cost() == pytest.approx(0.2, rel=0.05)
    assert c.relative(1) == 1.0


def test_adaptive_draft_length_field() -> None:
    """On unless turned off; the fixed proposer always offers k; a non-boolean is refused,
    naming the field."""
    from radixserve.core.request import Request
    from radixserve.core.spec_decode import NgramProposer, record_verify

    on = SpeculativeConfig.parse('{"num_speculative_tokens": 4}')
    assert on.adaptive_draft_length is True
    off = SpeculativeConfig.parse('{"num_speculative_tokens": 4, "adaptive_draft_length": false}')
    req = Request(request_id="r", prompt_token_ids=np.zeros(3, dtype=np.int32),
                  params=SamplingParams(), eos_token_ids=frozenset(), max_tokens=8)
    for _ in range(6):
        record_verify(req.draft_acceptance, 4, 0)
    assert NgramProposer(off, "cpu").draft_length(req) == 4
    assert NgramProposer(on, "cpu").draft_length(req) == 0
    with pytest.raises(ValueError, match=r"speculative_config.adaptive_draft_length=1 must be "
                                         r"true or false"):
        SpeculativeConfig.parse({"num_speculative_tokens": 4, "adaptive_draft_length": 1})
