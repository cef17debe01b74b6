"""Shadow checks (``--shadow-rate``): steps re-run on the reference path are compared and
counted, the served tokens always come from the fast path, and a perturbed fast path shows up
as divergences in ``/metrics``."""

from __future__ import annotations

import pytest

from radixserve import LLM, SamplingParams
from radixserve.metrics import ServerMetrics

pytestmark = pytest.mark.slow

PROMPTS = ["What is 2+2?", "Name three colors."]


def _tokens(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def shadow_llm() -> LLM:
    return LLM(dtype="float32", seed=0, num_pages=128, shadow_rate=1.0, quantization="none")


def test_shadow_checks_count_agreement_and_serve_the_fast_path(shadow_llm: LLM,
                                                               default_llm: LLM) -> None:
    before = shadow_llm.engine.get_stats().runner
    assert before is not None and before.shadow is not None
    got = _tokens(shadow_llm)
    # the reference rewrites the step's K/V slots and puts the fast path's values back: the
    # tokens are those of a server without shadow checks
    assert got == _tokens(default_llm)
    r = shadow_llm.engine.get_stats().runner
    assert r.paths["attention"] in ("cpu", "torch") and r.paths["linear"] in ("packed", "dense")
    checked = r.shadow.steps - before.shadow.steps
    assert checked == r.steps - before.steps > 0  # rate 1: every step
    assert r.shadow.tokens_agree - before.shadow.tokens_agree >= 2 * 6
    assert r.shadow.tokens_diverge == 0
    assert 0.0 <= r.shadow.max_abs_logit_diff < 1e-2  # float32: kernels vs SDPA/dense


def test_perturbed_fast_path_is_counted_as_divergence(shadow_llm: LLM) -> None:
    runner = shadow_llm.engine.runner
    forced = 1234
    orig = runner.model.compute_logits

    def perturbed(hidden):
        logits = orig(hidden)
        logits[:, forced] += 1000.0  # the fast path now always prefers one token
        return logits

    runner.model.compute_logits = perturbed
    try:
        before = shadow_llm.engine.get_stats().runner.shadow
        got = _tokens(shadow_llm)
    finally:
        runner.model.compute_logits = orig
    # served from the (perturbed) fast path, never from the reference
    assert all(t == [forced] * 6 for t in got)
    after = shadow_llm.engine.get_stats()
    sh = after.runner.shadow
    # at least the first token of each prompt (later, after a context of the forced token, the
    # reference may well predict it again)
    assert sh.tokens_diverge - before.tokens_diverge >= 2
    assert sh.max_abs_logit_diff > 100.0

    metrics = ServerMetrics(model_name="m")
    metrics.update_from_stats(after)
    text = metrics.render()[0].decode()
    assert f'radixserve:shadow_tokens_total{{model_name="m",result="diverge"}} ' \
           f'{float(sh.tokens_diverge)}' in text
    assert 'radixserve:forward_path_info{model_name="m",part="attention"' in text
    assert f'radixserve:shadow_steps_total{{model_name="m"}} {float(sh.steps)}' in text
