"""The scheduler + KV cache never corrupt KV: end-to-end runs of ``EngineCore`` over the
KV-checksum model (``kv_checksum.py``), whose every token is a hash of the whole sequence as read
back through the request's page table.

Expected outputs are computed straight from the token sequences, without the engine. Every step
also runs ``Scheduler.check_integrity`` (DESIGN §4's invariants), and the runner poisons free pages
and refuses writes into free or radix-tree pages. Workloads: shared prefixes, identical prompts in
one step, early stops (EOS and stop_token_ids), aborts, staggered arrivals, pools so small that
eviction and preemption happen constantly, page sizes 1/4/16, chunked prefill, prefix caching on
and off, fcfs and lpm, overlap on and off.

``RADIXSERVE_KV_EXAMPLES=N`` raises the number of random workloads (and draws them at random
instead of from the fixed seed).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_checksum import VOCAB, KVChecksumRunner, expected_output, next_token

from radixserve.config import EngineConfig
from radixserve.core.engine_core import EngineCore
from radixserve.engine_types import EngineRequest
from radixserve.sampling_params import SamplingParams

MAX_STEPS = 20_000


# ---------------------------------------------------------------------------- harness
@dataclass
class Spec:
    """One request of a workload."""

    rid: str
    prompt: list[int]
    max_tokens: int
    eos: tuple[int, ...] = ()
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    arrive: int = 0  # engine steps before it is added
    abort: int | None = None  # engine steps before it is aborted (>= arrive)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    stop_reason: int | None = None
    num_cached: int = 0
    num_prompt: int = 0


class Harness:
    """An ``EngineCore`` over a ``KVChecksumRunner`` with integrity checks on every step and a
    count of radix-tree evictions."""

    def __init__(self, *, page_size: int, num_pages: int, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 64, enable_prefix_caching: bool = True,
                 schedule_policy: str = "fcfs", disable_overlap: bool = True,
                 max_model_len: int | None = None, record: bool = False) -> None:
        if max_model_len is None:
            max_model_len = (num_pages - 1) * page_size  # what ModelRunner caps it to
        self.runner = KVChecksumRunner(num_pages, page_size, max_model_len, VOCAB, record=record)
        self.engine = EngineCore(
            EngineConfig(model=None, page_size=page_size, num_pages=num_pages,
                         max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         enable_prefix_caching=enable_prefix_caching,
                         schedule_policy=schedule_policy, disable_overlap=disable_overlap),
            self.runner)
        self.engine.check_integrity_each_step = True
        self.runner.attach(self.engine)
        self.max_model_len = max_model_len
        self.evicted_pages = 0
        tree = self.engine.kv.tree
        if tree is not None:
            evict = tree.evict

            def counting_evict(n_pages: int) -> int:
                freed = evict(n_pages)
                self.evicted_pages += freed
                return freed

            tree.evict = counting_evict  # type: ignore[method-assign]
        self.results: dict[str, Result] = {}
        self.steps = 0

    def add(self, spec: Spec) -> None:
        sp = SamplingParams(temperature=0, max_tokens=spec.max_tokens,
                            ignore_eos=spec.ignore_eos,
                            stop_token_ids=list(spec.stop_ids) or None)
        self.engine.add_request(EngineRequest(
            request_id=spec.rid, prompt_token_ids=np.asarray(spec.prompt, dtype=np.int32),
            sampling_params=sp, eos_token_ids=list(spec.eos)))
        self.results[spec.rid] = Result()

    def abort(self, rids: list[str]) -> None:
        self.engine.abort_requests(rids)
        self.engine.scheduler.check_integrity()

    def step(self) -> None:
        out = self.engine.step()
        self.steps += 1
        assert self.steps < MAX_STEPS, "no progress (livelock?)"
        if out is None:
            return
        for o in out.all_outputs():
            res = self.results[o.request_id]
            assert res.finish is None, f"{o.request_id} got output after finishing ({o})"
            new = list(o.new_token_ids)
            if o.finish_reason == "abort":
                assert new == []
            if not res.tokens:  # a request's first output is a full struct
                assert o.num_prompt_tokens or o.finish_reason == "abort", o
            res.tokens += new
            res.finish = o.finish_reason
            res.stop_reason = o.stop_reason
            if o.num_prompt_tokens:  # 0: a column-wise decode (carries no prompt info)
                res.num_cached = o.num_cached_tokens
                res.num_prompt = o.num_prompt_tokens

    def run(self, specs: list[Spec]) -> dict[str, Result]:
        """Add, abort and step per the specs' schedules until everything finished."""
        pending = sorted(specs, key=lambda s: s.arrive)
        aborts = sorted((s for s in specs if s.abort is not None), key=lambda s: s.abort)
        t = 0
        while pending or aborts or self.engine.has_unfinished_requests():
            while pending and pending[0].arrive <= t:
                self.add(pending.pop(0))
            while aborts and aborts[0].abort <= t and aborts[0].rid in self.results:
                self.abort([aborts.pop(0).rid])
            self.step()
            t += 1
        return self.results

    def expected(self, spec: Spec) -> tuple[list[int], str, int | None]:
        return expected_output(spec.prompt, spec.max_tokens, eos_ids=spec.eos,
                               stop_ids=spec.stop_ids, ignore_eos=spec.ignore_eos,
                               max_model_len=self.max_model_len)

    def check(self, specs: list[Spec]) -> None:
        """Every output equals the directly computed one (aborted: a strict prefix of it)."""
        for s in specs:
            res = self.results[s.rid]
            want, finish, stop_reason = self.expected(s)
            assert res.finish is not None, f"{s.rid} never finished"
            if res.finish == "abort":
                assert s.abort is not None, f"{s.rid} aborted but nobody aborted it"
                assert res.tokens == want[:len(res.tokens)], f"{s.rid}: corrupt before abort"
                assert len(res.tokens) < len(want)
            else:
                assert (res.tokens, res.finish, res.stop_reason) == (want, finish, stop_reason), (
                    f"{s.rid}: KV corrupted (prompt {len(s.prompt)} tokens)")
            assert res.num_prompt == len(s.prompt)

    def check_drained(self) -> None:
        """No live request; every page is free or in the radix tree, none leaked or locked."""
        eng = self.engine
        assert not eng.has_unfinished_requests()
        assert not eng.scheduler.running and not eng.scheduler.waiting
        assert not eng.scheduler.requests
        eng.scheduler.check_integrity()
        kv = eng.kv
        assert kv.num_free_pages + kv.num_cached_pages == kv.num_usable_pages
        if kv.tree is not None:
            assert kv.tree.protected_pages == 0
            assert kv.tree.evictable_pages == kv.tree.total_pages
            assert all(n.lock_ref == 0 for n in kv.tree.all_nodes() if n is not kv.tree.root)
        else:
            assert kv.num_free_pages == kv.num_usable_pages
        assert not eng.scheduler.tables.page_table.any(), "page table rows left set"


def need_pages(spec: Spec, page_size: int) -> int:
    return -(-(len(spec.prompt) + spec.max_tokens) // page_size)


def rand_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, n).tolist()


# ---------------------------------------------------------------------------- the model itself
def test_checksum_model_detects_a_freed_page_still_in_use():
    """Sanity check of the test tool: a page freed behind the scheduler's back (the #142 bug)
    changes the very next token of the request reading it."""
    rng = np.random.default_rng(1)
    h = Harness(page_size=4, num_pages=40)
    h.engine.check_integrity_each_step = False
    spec = Spec("a", rand_tokens(rng, 21), max_tokens=10, ignore_eos=True)
    h.add(spec)
    h.step()
    h.step()
    req = h.engine.scheduler.running[0]
    page = int(h.engine.scheduler.tables.page_table[req.row, 1])
    h.engine.kv.pool.free([page])  # corrupt: a live page on the free list
    # the page is the request's own or (prompt pages are shared after prefill) a tree page
    with pytest.raises(AssertionError, match="free list|both free and cached"):
        h.engine.scheduler.check_integrity()
    h.step()
    want = h.expected(spec)[0]
    assert h.results["a"].tokens[:2] == want[:2]
    assert h.results["a"].tokens[2] != want[2], "poisoned page went unnoticed"


def test_checksum_model_detects_a_wrong_page_table_entry():
    rng = np.random.default_rng(2)
    h = Harness(page_size=4, num_pages=40)
    h.engine.check_integrity_each_step = False
    specs = [Spec(f"r{i}", rand_tokens(rng, 13), max_tokens=6, ignore_eos=True)
             for i in range(2)]
    for s in specs:
        h.add(s)
    h.step()
    sched = h.engine.scheduler
    a, b = sched.running
    pt = sched.tables.page_table
    pt[a.row, 0], pt[b.row, 0] = pt[b.row, 0], pt[a.row, 0]  # swap two owned pages
    h.step()
    for s in specs:
        assert h.results[s.rid].tokens[1] != h.expected(s)[0][1]


# ---------------------------------------------------------------------------- deterministic
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("identical", [False, True])
@pytest.mark.parametrize("early_first", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_minisglang_142_same_prefix_prefilled_together_one_stops_early(
        page_size, identical, early_first, overlap):
    """Two requests with one long prefix are prefilled in the same step; one stops after its
    first token (max_tokens=1) while the other decodes on; then a third request reusing the
    prefix arrives while the second still decodes, in a pool so small that eviction happens."""
    rng = np.random.default_rng(142 + page_size)
    prefix = rand_tokens(rng, 6 * page_size if page_size > 1 else 24)
    tail = rand_tokens(rng, 3)
    early = Spec("early", prefix + tail, max_tokens=1)
    late = Spec("late", prefix + (tail if identical else rand_tokens(rng, 3)), max_tokens=24,
                ignore_eos=True)
    third = Spec("third", prefix + rand_tokens(rng, 5), max_tokens=12, ignore_eos=True,
                 arrive=2)
    specs = [early, late] if early_first else [late, early]
    # Both prompts fit in one step (plus the admission reserve), and "late" and "third" fit
    # together only because the prefix is shared.
    prefix_pages = len(prefix) // page_size
    pool = 1 + max(2 * -(-len(late.prompt) // page_size) + 1,
                   need_pages(late, page_size) + need_pages(third, page_size) - prefix_pages)
    # A filler as large as the pool allows: it can only run once the cached pages are evicted.
    filler = Spec("filler", rand_tokens(rng, (pool - 1) * page_size - 2), max_tokens=2,
                  ignore_eos=True, arrive=3)
    specs += [third, filler]
    h = Harness(page_size=page_size, num_pages=pool + 1, max_num_batched_tokens=4096,
                disable_overlap=not overlap)
    h.runner.record = True
    h.run(specs)
    h.check(specs)
    h.check_drained()
    batches = h.runner.batches
    b0 = batches[0]
    assert set(b0.request_ids) == {"early", "late"}, "not prefilled in the same step"
    # the third request reused the prefix (while "late" still decoded) unless preempted first
    assert h.results["third"].num_cached >= len(prefix) - page_size
    assert any("third" in b.request_ids and "late" in b.request_ids for b in batches)
    assert h.evicted_pages > 0


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_prefix_reuse_computes_only_the_suffix(page_size):
    rng = np.random.default_rng(7)
    prefix = rand_tokens(rng, 300)
    a = Spec("a", prefix + rand_tokens(rng, 5), max_tokens=4, ignore_eos=True)
    b_suffix = rand_tokens(rng, 20)
    b_suffix[0] = (a.prompt[300] + 1) % VOCAB  # diverges right after the shared 300 tokens
    b = Spec("b", prefix + b_suffix, max_tokens=3, ignore_eos=True)
    h = Harness(page_size=page_size, num_pages=2000 // page_size + 2,
                max_num_batched_tokens=128, record=True)
    h.run([a])
    h.run([b])
    h.check([a, b])
    h.check_drained()
    cached = h.results["b"].num_cached
    assert cached >= 300 - page_size
    assert cached <= 300 and cached % page_size == 0
    assert h.results["a"].num_cached == 0
    # B's prefill computed exactly its uncached prompt tokens, starting right after the match
    assert h.runner.prefill_tokens("b", len(b.prompt)) == len(b.prompt) - cached
    assert h.runner.computed["b"][0][0] == cached
    assert h.runner.prefill_tokens("a", len(a.prompt)) == len(a.prompt)


@pytest.mark.parametrize("overlap", [False, True])
def test_requests_admitted_together_decode_into_page_runs(overlap):
    """Each request's pages are consecutive ids (``PagePool``'s runs), through chunked prefill
    and decode, when requests are admitted together and grow in lockstep; outputs stay exact."""
    rng = np.random.default_rng(11)
    specs = [Spec(f"r{i}", rand_tokens(rng, 10 + 3 * i), max_tokens=22, ignore_eos=True)
             for i in range(6)]
    h = Harness(page_size=4, num_pages=200, max_num_batched_tokens=40,
                disable_overlap=not overlap)
    for s in specs:
        h.add(s)
    seen = 0
    while h.engine.has_unfinished_requests():
        h.step()
        sched = h.engine.scheduler
        for req in sched.running:
            pages = sched.tables.page_table[req.row, :req.num_pages]
            assert (np.diff(pages) == 1).all(), f"{req.request_id} pages {pages.tolist()}"
            seen = max(seen, req.num_pages)
    assert seen >= 8  # decode crossed several pages
    h.check(specs)
    h.check_drained()


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_caching_off_recomputes_everything(page_size):
    rng = np.random.default_rng(8)
    prefix = rand_tokens(rng, 100)
    a = Spec("a", prefix + [1, 2], max_tokens=3, ignore_eos=True)
    b = Spec("b", prefix + [3, 4], max_tokens=3, ignore_eos=True)
    h = Harness(page_size=page_size, num_pages=400 // page_size + 2,
                enable_prefix_caching=False)
    h.run([a])
    h.run([b])
    h.check([a, b])
    h.check_drained()
    assert h.results["b"].num_cached == 0
    assert h.runner.prefill_tokens("b", len(b.prompt)) == len(b.prompt)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batches_keep_decoding_during_a_long_prefill(page_size):
    """Four requests decode; a 2,000-token prompt arrives with a 256-token budget: every step
    until its prefill ends holds all four decodes plus a chunk of the prompt."""
    rng = np.random.default_rng(3)
    decoders = [Spec(f"d{i}", rand_tokens(rng, 10), max_tokens=30, ignore_eos=True)
                for i in range(4)]
    long = Spec("long", rand_tokens(rng, 2000), max_tokens=5, ignore_eos=True)
    h = Harness(page_size=page_size, num_pages=4000 // page_size + 2,
                max_num_batched_tokens=256, record=True)
    for s in decoders:
        h.add(s)
    h.step()  # all four prefilled in one step
    assert h.runner.batches[0].request_ids == [s.rid for s in decoders]
    h.add(long)
    first = len(h.runner.batches)
    while h.engine.scheduler.requests["long"].num_computed < 2000:
        h.step()
    chunks = h.runner.batches[first:]
    budget = 256 - 4
    assert len(chunks) == -(-2000 // budget)
    done = 0
    for b in chunks:
        assert b.num_decodes == 4
        assert sorted(b.request_ids[:4]) == [s.rid for s in decoders]
        assert b.request_ids[4:] == ["long"]
        assert int(b.start[4]) == done
        assert int(b.num_new[4]) == min(budget, 2000 - done)
        assert int(b.num_new.sum()) <= 256
        done += int(b.num_new[4])
    assert done == 2000 and chunks[-1].sample[4]
    h.run([])
    h.check(decoders + [long])
    h.check_drained()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_keeps_outputs_exact(page_size, prefix_caching, policy, overlap):
    """Six long generations in a pool that holds about one and a half of them: decodes run out
    of pages constantly, the newest request is preempted and later recomputed."""
    rng = np.random.default_rng(11)
    shared = rand_tokens(rng, 2 * page_size + 3)
    specs = [Spec(f"r{i}", shared + rand_tokens(rng, 5 + i), max_tokens=40, ignore_eos=True)
             for i in range(6)]
    most = max(need_pages(s, page_size) for s in specs)
    h = Harness(page_size=page_size, num_pages=most + most // 2 + 1,
                enable_prefix_caching=prefix_caching, schedule_policy=policy,
                max_num_batched_tokens=48, disable_overlap=not overlap)
    h.run(specs)
    h.check(specs)
    h.check_drained()
    assert h.engine.scheduler.num_preemptions > 0
    if prefix_caching:
        assert h.evicted_pages > 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_early_stops_at_known_positions_with_shared_prefix(page_size):
    """EOS and stop_token_ids picked from each request's own expected stream, so requests sharing
    a prefix stop after 1, 2, 3, ... tokens while the others go on, in a tight pool."""
    rng = np.random.default_rng(5)
    prefix = rand_tokens(rng, 5 * page_size + 2)
    specs = []
    for i in range(8):
        prompt = prefix + rand_tokens(rng, i % 3)
        stream = expected_output(prompt, 30)[0]
        stop_at = i % 5  # index of the token that ends it
        if stream[stop_at] in stream[:stop_at]:
            continue
        if i % 2:
            specs.append(Spec(f"r{i}", prompt, 30, eos=(stream[stop_at],)))
        else:
            specs.append(Spec(f"r{i}", prompt, 30, stop_ids=(stream[stop_at],)))
    most = max(need_pages(s, page_size) for s in specs)
    h = Harness(page_size=page_size, num_pages=most + 3, max_num_batched_tokens=32)
    h.run(specs)
    h.check(specs)
    h.check_drained()
    for s in specs:
        want, finish, reason = h.expected(s)
        assert finish == "stop" and len(want) <= 5
        assert h.results[s.rid].stop_reason == (s.stop_ids[0] if s.stop_ids else None)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("overlap", [False, True])
def test_aborts_waiting_prefilling_and_decoding(prefix_caching, overlap):
    rng = np.random.default_rng(9)
    ps = 4
    prefix = rand_tokens(rng, 17)
    specs = [Spec(f"r{i}", prefix + rand_tokens(rng, 30 * (i == 1) + 3), max_tokens=20,
                  ignore_eos=True) for i in range(5)]
    h = Harness(page_size=ps, num_pages=60, max_num_seqs=3, max_num_batched_tokens=16,
                enable_prefix_caching=prefix_caching, disable_overlap=not overlap)
    for s in specs:
        h.add(s)
    h.step()
    sched = h.engine.scheduler
    assert {r.request_id for r in sched.waiting} >= {"r3", "r4"}
    h.abort(["r4"])  # waiting
    specs[4].abort = 1
    while sched.requests["r1"].num_computed == 0 or "r1" not in [
            r.request_id for r in sched.running]:
        h.step()
    assert sched.requests["r1"].num_computed < len(specs[1].prompt)
    h.abort(["r1"])  # mid-prefill
    specs[1].abort = 1
    while len(h.results["r0"].tokens) < 3:
        h.step()
    h.abort(["r0", "r0", "nonexistent"])  # decoding; duplicate and unknown ids are ignored
    specs[0].abort = 1
    h.run([])
    h.abort(["r2"])  # already finished: ignored
    h.check(specs)
    h.check_drained()
    assert h.results["r4"].tokens == [] and h.results["r1"].tokens == []
    assert 3 <= len(h.results["r0"].tokens) < 20
    assert h.results["r2"].finish == "length"


def test_max_model_len_ends_generation():
    rng = np.random.default_rng(4)
    s = Spec("a", rand_tokens(rng, 10), max_tokens=100, ignore_eos=True)
    h = Harness(page_size=4, num_pages=20, max_model_len=17)
    h.run([s])
    h.check([s])
    assert len(h.results["a"].tokens) == 7 and h.results["a"].finish == "length"


def test_request_larger_than_pool_is_rejected():
    """max_model_len is capped to what the pool holds: a prompt that cannot fit is rejected
    with an error naming the pool; a long max_tokens ends with "length" at the cap."""
    h = Harness(page_size=4, num_pages=5, max_model_len=100)  # 4 usable pages = 16 tokens
    assert h.engine.max_model_len == 16
    with pytest.raises(ValueError, match="KV pool holds 16 tokens"):
        h.engine.add_request(EngineRequest(
            request_id="big", prompt_token_ids=np.arange(20, dtype=np.int32),
            sampling_params=SamplingParams(temperature=0, max_tokens=1), eos_token_ids=[]))
    h.check_drained()
    h.engine.add_request(EngineRequest(
        request_id="long", prompt_token_ids=np.arange(10, dtype=np.int32),
        sampling_params=SamplingParams(temperature=0, max_tokens=50), eos_token_ids=[]))
    outs = []
    while h.engine.has_unfinished_requests():
        step = h.engine.step()
        outs += step.all_outputs() if step else []
    assert sum(len(o.new_token_ids) for o in outs) == 6
    assert outs[-1].finish_reason == "length"
    h.check_drained()


def test_next_token_matches_expected_stream():
    prompt = [5, 0, 7]
    out, _, _ = expected_output(prompt, 4)
    seq = list(prompt)
    for t in out:
        assert next_token(seq) == t
        seq.append(t)


# ---------------------------------------------------------------------------- hypothesis
N_EXAMPLES = int(os.environ.get("RADIXSERVE_KV_EXAMPLES", "0"))


@st.composite
def workloads(draw):
    ps = draw(st.sampled_from([1, 4, 16]))
    cfg = dict(
        page_size=ps,
        enable_prefix_caching=draw(st.sampled_from([True, True, False])),
        schedule_policy=draw(st.sampled_from(["fcfs", "lpm"])),
        disable_overlap=draw(st.booleans()),
        max_num_seqs=draw(st.sampled_from([1, 2, 3, 4, 8, 64])),
        max_num_batched_tokens=draw(st.sampled_from([1, 2, 3, 7, 16, 40, 128, 4096])),
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    prefixes = [rand_tokens(rng, draw(st.integers(0, 3 * ps + 5)))
                for _ in range(draw(st.integers(1, 3)))]
    eos = tuple(rng.choice(VOCAB, draw(st.sampled_from([0, 5, 20, 60])), replace=False).tolist())
    specs: list[Spec] = []
    for i in range(draw(st.integers(1, 8))):
        arrive = draw(st.sampled_from([0, 0, 0, 1, 3, 8]))
        if specs and draw(st.integers(0, 3)) == 0:  # an identical prompt, maybe in one step
            other = specs[draw(st.integers(0, len(specs) - 1))]
            prompt = list(other.prompt)
            if draw(st.booleans()):
                arrive = other.arrive
        else:
            pre = prefixes[draw(st.integers(0, len(prefixes) - 1))]
            prompt = pre + rand_tokens(rng, draw(st.integers(0 if pre else 1, 12)))
        stop_ids = tuple(rng.choice(VOCAB, draw(st.sampled_from([0, 0, 10])),
                                    replace=False).tolist())
        abort = draw(st.one_of(st.none(), st.none(), st.integers(arrive, arrive + 20)))
        specs.append(Spec(f"r{i}", prompt, draw(st.integers(1, 24)), eos=eos,
                          stop_ids=stop_ids, ignore_eos=draw(st.booleans()), arrive=arrive,
                          abort=abort))
    most = max(need_pages(s, ps) for s in specs)
    num_pages = most + 1 + draw(st.sampled_from([0, 0, 1, 2, 5, 300]))
    return cfg, specs, num_pages


def test_random_workloads_never_corrupt_kv():
    totals: Counter[str] = Counter()

    @settings(max_examples=N_EXAMPLES or 500, deadline=None, derandomize=not N_EXAMPLES,
              database=None, suppress_health_check=list(HealthCheck))
    @given(workloads())
    def run(w):
        cfg, specs, num_pages = w
        h = Harness(num_pages=num_pages, **cfg)
        h.run(specs)
        h.check(specs)
        h.check_drained()
        totals["examples"] += 1
        totals["preemptions"] += h.engine.scheduler.num_preemptions
        totals["evicted_pages"] += h.evicted_pages
        totals["cached_tokens"] += sum(r.num_cached for r in h.results.values())
        totals["aborted"] += sum(r.finish == "abort" for r in h.results.values())
        totals["early_stops"] += sum(r.finish == "stop" for r in h.results.values())
        totals["steps"] += h.steps

    run()
    # the workloads really exercised what they are meant to
    assert totals["preemptions"] > 0, totals
    assert totals["evicted_pages"] > 0, totals
    assert totals["cached_tokens"] > 0, totals
    assert totals["aborted"] > 0, totals
    assert totals["early_stops"] > 0, totals
