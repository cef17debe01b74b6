"""OutputProcessor: engine steps (full outputs and column-wise decodes) -> per-request deltas,
with the default model's tokenizer and, for a real step sequence, an ``EngineCore`` over the
null runner (no weights)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from radixserve.config import EngineConfig
from radixserve.engine_types import EngineRequest, StepOutputs, TokenOutput
from radixserve.frontend.output_processor import OutputProcessor
from radixserve.sampling_params import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _step(step: int, outputs: list[TokenOutput] = (), decodes: dict[str, int] | None = None
          ) -> StepOutputs:
    decodes = decodes or {}
    return StepOutputs(step=step, outputs=list(outputs), decode_request_ids=list(decodes),
                       decode_token_ids=np.array(list(decodes.values()), dtype=np.int32))


def test_columns_and_full_outputs_make_exact_text(tok) -> None:
    prompt = _ids(tok, "Count: 1, 2,")
    a_ids = _ids(tok, " 3, 4, 5, 6")
    b_ids = _ids(tok, " hello there friend")
    proc = OutputProcessor(tok)
    a = proc.add_request("a", prompt, SamplingParams(), 10.0, index=0)
    b = proc.add_request("b", prompt, SamplingParams(), 10.0, index=1)
    with pytest.raises(ValueError, match="already in flight"):
        proc.add_request("a", prompt, SamplingParams(), 10.0)
    # first tokens come as full outputs (prompt facts), the rest column-wise
    first = proc.process(_step(1, [
        TokenOutput(request_id="a", new_token_ids=[a_ids[0]], num_prompt_tokens=len(prompt),
                    num_cached_tokens=3),
        TokenOutput(request_id="b", new_token_ids=[b_ids[0]], num_prompt_tokens=len(prompt))]))
    assert [d.request_id for d in first.deltas] == ["a", "b"] and first.abort_ids == []
    assert a.first_token_time is not None and a.num_cached_tokens == 3
    texts = {"a": "".join(d.text for d in first.deltas[:1]),
             "b": "".join(d.text for d in first.deltas[1:])}
    tokens = {"a": list(first.deltas[0].token_ids), "b": list(first.deltas[1].token_ids)}
    n = min(len(a_ids), len(b_ids))
    for i in range(1, n - 1):
        out = proc.process(_step(1 + i, decodes={"a": a_ids[i], "b": b_ids[i]}))
        assert out.abort_ids == []
        for d in out.deltas:
            assert d.finish_reason is None and d.logprob_rows is None and d.state.index in (0, 1)
            texts[d.request_id] += d.text
            tokens[d.request_id] += d.token_ids
    # the engine finishes both ("length", then EOS as a stop token)
    last = proc.process(_step(n, [
        TokenOutput(request_id="a", new_token_ids=[a_ids[n - 1]], finish_reason="length",
                    queue_time=0.125),
        TokenOutput(request_id="b", new_token_ids=[b_ids[n - 1]], finish_reason="stop",
                    stop_reason=b_ids[n - 1])]))
    for d in last.deltas:
        assert d.finished
        texts[d.request_id] += d.text
        tokens[d.request_id] += d.token_ids
    assert tokens == {"a": a_ids[:n], "b": b_ids[:n]}
    assert texts["a"] == tok.decode(a_ids[:n]) == a.text
    assert texts["b"] == tok.decode(b_ids[:n]) == b.text
    assert (a.finish_reason, a.stop_reason, a.queue_time) == ("length", None, 0.125)
    assert (b.finish_reason, b.stop_reason) == ("stop", b_ids[n - 1])
    assert len(proc) == 0
    # outputs for requests no longer tracked are ignored
    assert proc.process(_step(99, decodes={"a": 5})).deltas == []


def test_stop_string_finishes_and_asks_for_the_abort(tok) -> None:
    prompt = _ids(tok, "List:")
    gen = _ids(tok, " apples, pears and plums")
    proc = OutputProcessor(tok)
    st = proc.add_request("s", prompt, SamplingParams(stop=["pears"]), 0.0)
    proc.process(_step(1, [TokenOutput(request_id="s", new_token_ids=[gen[0]],
                                       num_prompt_tokens=len(prompt))]))
    aborts, finished = [], []
    for i, t in enumerate(gen[1:]):
        out = proc.process(_step(2 + i, decodes={"s": t}))
        aborts += out.abort_ids
        finished += [d for d in out.deltas if d.finished]
        if finished:
            break
    assert aborts == ["s"] and len(finished) == 1
    d = finished[0]
    assert d.finish_reason == "stop" and d.stop_reason == "pears"
    assert st.text == " apples, " and st.finish_reason == "stop"
    assert len(proc) == 0


def test_held_back_text_makes_no_delta_until_it_shows(tok) -> None:
    ids = _ids(tok, "😀")
    assert len(ids) > 1  # a multi-byte character split over tokens
    proc = OutputProcessor(tok)
    proc.add_request("e", _ids(tok, "Smile:"), SamplingParams(), 0.0)
    out = proc.process(_step(1, [TokenOutput(request_id="e", new_token_ids=[ids[0]],
                                             num_prompt_tokens=2)]))
    assert out.deltas == []  # an incomplete character: nothing to show, no object made
    for i, t in enumerate(ids[1:-1]):
        assert proc.process(_step(2 + i, decodes={"e": t})).deltas == []
    out = proc.process(_step(9, decodes={"e": ids[-1]}))
    (d,) = out.deltas
    assert d.text == "😀" and d.token_ids == ids  # the held tokens travel with the text


def test_logprobs_and_rejections(tok) -> None:
    proc = OutputProcessor(tok)
    st = proc.add_request("l", [1, 2], SamplingParams(logprobs=1), 0.0)
    rows = [[[5.0, -0.5], [5.0, -0.5]]]
    d1 = proc.process(_step(1, [TokenOutput(request_id="l", new_token_ids=[5], logprobs=rows,
                                            num_prompt_tokens=2)])).deltas[0]
    assert d1.logprob_rows == rows and d1.token_ids == [5]
    d2 = proc.process(_step(2, [TokenOutput(request_id="l", new_token_ids=[6],
                                            logprobs=[[[6.0, -1.0]]],
                                            finish_reason="length")])).deltas[0]
    assert d2.logprob_rows == [[[6.0, -1.0]]] and d2.finish_reason == "length"
    assert st.logprob_rows == rows + [[[6.0, -1.0]]]
    # a rejection: reported on the request, with the field at fault
    rej = proc.add_request("r", [1], SamplingParams(), 0.0)
    (d,) = proc.process(_step(3, [TokenOutput(
        request_id="r", finish_reason="abort", error="prompt too long", error_param="prompt",
        error_code="context_length_exceeded")])).deltas
    assert (d.finish_reason, d.error, d.error_param, d.error_code) == (
        "abort", "prompt too long", "prompt", "context_length_exceeded")
    assert rej.finish_reason == "abort" and rej.error_param == "prompt" and len(proc) == 0
    # an abort the engine did on its own carries no error
    proc.add_request("x", [1], SamplingParams(), 0.0)
    (d,) = proc.process(_step(4, [TokenOutput(request_id="x", finish_reason="abort")])).deltas
    assert d.finish_reason == "abort" and d.error is None
    # a request the caller aborted is forgotten
    proc.add_request("y", [1], SamplingParams(), 0.0)
    proc.abort_requests(["y", "unknown"])
    assert len(proc) == 0


def test_engine_fills_in_max_tokens_none(tok) -> None:
    """The frontend sends ``max_tokens=None`` for "all the room left"; a real ``EngineCore``
    (null runner, max_model_len 48) fills it in, and the processor reads its real steps."""
    from radixserve.core.engine_core import EngineCore
    from radixserve.model_executor.null_runner import NullRunner

    runner = NullRunner(num_pages=8, max_model_len=48, vocab_size=49152)
    engine = EngineCore(EngineConfig(page_size=16, num_pages=8, max_num_seqs=4,
                                     disable_overlap=True), runner)
    proc = OutputProcessor(tok)
    prompt = _ids(tok, "one two three four five six seven eight nine ten")
    want = engine.max_model_len - len(prompt)
    states = []
    for rid, sp in (("none", SamplingParams(max_tokens=None, ignore_eos=True)),
                    ("stop", SamplingParams(max_tokens=None, ignore_eos=True,
                                            stop=[tok.decode([runner.token_id]) * 3]))):
        states.append(proc.add_request(rid, prompt, sp, 0.0))
        engine.add_request(EngineRequest(request_id=rid, prompt_token_ids=np.asarray(
            prompt, dtype=np.int32), sampling_params=sp))
    columns = 0
    while engine.has_unfinished_requests():
        step = engine.step()
        if step is None:
            continue
        columns += len(step.decode_request_ids)
        out = proc.process(step)
        if out.abort_ids:
            engine.abort_requests(out.abort_ids, notify=False)
    none, stop = states
    assert none.finish_reason == "length" and none.num_tokens == want
    assert none.text == tok.decode([runner.token_id] * want)
    assert stop.finish_reason == "stop" and stop.num_tokens == 3 and stop.text == ""
    assert columns > 0  # the column-wise path was exercised
    engine.shutdown()


def test_length_finish_mid_character_drops_the_incomplete_tail(tok) -> None:
    # " 你好" is [" ", 3 tokens for 你, 2 for 好]: max_tokens=4 cuts 好 after its first byte
    ids = _ids(tok, " 你好")
    assert tok.decode(ids[:4]).endswith("\ufffd")
    proc = OutputProcessor(tok)
    st = proc.add_request("c", _ids(tok, "Say hello:"), SamplingParams(max_tokens=4), 0.0)
    texts = []
    for i, t in enumerate(ids[:3]):
        out = proc.process(_step(1 + i, [TokenOutput(request_id="c", new_token_ids=[t],
                                                     num_prompt_tokens=3)]))
        texts += [d.text for d in out.deltas]
    out = proc.process(_step(4, [TokenOutput(request_id="c", new_token_ids=[ids[3]],
                                             finish_reason="length")]))
    (d,) = out.deltas
    assert d.finish_reason == "length" and d.token_ids == [ids[3]]
    texts.append(d.text)
    assert "".join(texts) == st.text == " 你" and "\ufffd" not in d.text
