"""The copy-heavy and plain chat bench prompt sets over the default tokenizer (deterministic per
seed, prompt lengths within one word of what was asked, the copy passage holding the word to
change, the chat template for token-id engines), selected by name from ``bench serve`` and
``bench offline``; and the speculative-decoding counters read back from a server's
``/metrics`` text."""

from __future__ import annotations

import pytest

from radixserve.bench import datasets as ds
from radixserve.bench.cli import _serve_prompts
from radixserve.bench.serve import parse_spec_counts
from radixserve.cli import build_parser
from radixserve.engine_types import SchedulerStats, SpecDecodeCounts
from radixserve.metrics import ServerMetrics


@pytest.mark.parametrize("input_len", [96, 400])
def test_copy_prompts_repeat_a_passage_of_the_length_asked(tok, input_len: int) -> None:
    prompts = ds.copy_prompts(4, input_len, None, tok, seed=3)
    assert [p.token_ids for p in ds.copy_prompts(4, input_len, None, tok, seed=3)] == [
        p.token_ids for p in prompts]
    assert [p.text for p in ds.copy_prompts(4, input_len, None, tok, seed=4)] != [
        p.text for p in prompts]
    for p in prompts:
        assert p.text is not None
        assert p.token_ids == tok.encode(p.text, add_special_tokens=False)
        assert input_len - 8 <= len(p.token_ids) <= input_len, len(p.token_ids)
        head, passage = p.text.split("\n\n", 1)
        old = head.split('"')[1]
        assert old in [w.strip(".,") for w in passage.split()]  # something to change
        n_passage = len(tok.encode(passage, add_special_tokens=False))
        assert p.output_len == n_passage + 8
    assert {p.output_len for p in ds.copy_prompts(3, input_len, 50, tok)} == {50}
    with pytest.raises(ValueError, match="no room"):
        ds.copy_prompts(1, 10, None, tok)


def test_chat_prompts_end_with_a_question_after_background(tok) -> None:
    prompts = ds.chat_prompts(5, 200, 64, tok, seed=1)
    assert [p.text for p in ds.chat_prompts(5, 200, 64, tok, seed=1)] == [
        p.text for p in prompts]
    assert len({p.text.rsplit("\n\n", 1)[1] for p in prompts if p.text}) > 1
    for p in prompts:
        assert p.text is not None and p.text.startswith("Some background: ")
        assert p.text.endswith(("?", "."))
        assert p.token_ids == tok.encode(p.text, add_special_tokens=False)
        assert 200 - 8 <= len(p.token_ids) <= 200 and p.output_len == 64
    short = ds.chat_prompts(2, 5, 16, tok)  # no room for background: the question alone
    assert all("background" not in (p.text or "") for p in short)


def test_as_chat_wraps_the_text_in_the_chat_template(tok) -> None:
    p = ds.copy_prompts(1, 80, None, tok)[0]
    (c,) = ds.as_chat([p], tok)
    want = tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=True,
                                   add_generation_prompt=True)
    if not isinstance(want, list):  # transformers 5 returns an encoding
        want = want["input_ids"]
    assert c.token_ids == list(want) and len(c.token_ids) > len(p.token_ids)
    assert c.text == p.text and c.output_len == p.output_len


def test_bench_commands_select_the_sets_by_name(tok) -> None:
    parser = build_parser()
    ns = parser.parse_args(["bench", "serve", "--dataset-name", "copy",
                            "--random-input-len", "120"])
    copy = _serve_prompts(ns, tok, 0, 3)
    assert [p.token_ids for p in copy] == [p.token_ids for p in ds.copy_prompts(3, 120, None,
                                                                                 tok)]
    ns = parser.parse_args(["bench", "serve", "--dataset-name", "chat",
                            "--random-input-len", "120", "--random-output-len", "30"])
    assert [p.output_len for p in _serve_prompts(ns, tok, 0, 2)] == [30, 30]
    ns = parser.parse_args(["bench", "offline", "--dataset-name", "chat"])
    assert ns.dataset_name == "chat" and ns.dataset is None


def test_spec_counts_read_back_from_metrics_text() -> None:
    m = ServerMetrics(model_name="m")
    counts = SpecDecodeCounts(num_drafts=6, num_draft_tokens=17, num_accepted_tokens=9,
                              accepted_per_pos=[5, 3, 1])
    m.update_from_stats(SchedulerStats(spec_decode=counts))
    assert parse_spec_counts(m.render()[0].decode()) == counts
    vllm = ('vllm:spec_decode_num_drafts_total{engine="0",model_name="x"} 4.0\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="x"} 12.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="x"} 7.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="x",'
            'position="1"} 2.0\n')
    assert parse_spec_counts(vllm) == SpecDecodeCounts(
        num_drafts=4, num_draft_tokens=12, num_accepted_tokens=7, accepted_per_pos=[0, 2])
    # a server without speculation reports zeros; a text without the counters gives None
    assert parse_spec_counts(ServerMetrics(model_name="m").render()[0].decode()) == (
        SpecDecodeCounts())
    assert parse_spec_counts('radixserve:num_requests_running{model_name="m"} 0.0\n') is None
