"""Tool calls without the model: Hermes parsing, "required" arrays, named calls, the streamed
deltas (fed in every split) matching the whole message, and how tools reach the prompt of a
template that ignores them (SmolLM2's) and of one that renders them."""

from __future__ import annotations

import json

import pytest

from radixserve.entrypoints.openai.errors import OpenAIError
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest
from radixserve.entrypoints.openai.tool_calls import (
    ToolOutput,
    parse_hermes,
    parse_required,
    tool_prompt,
)
from radixserve.frontend.tokenizer import FrontendTokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
          '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
          '\n</tool_call>')


def _fn(call):
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_parse_hermes_calls_and_content():
    content, calls = parse_hermes(HERMES)
    assert content.strip() == "Let me check."
    assert [_fn(c) for c in calls] == [("get_weather", {"city": "Paris"}),
                                       ("get_weather", {"city": "Rome"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert parse_hermes("just text") == ("just text", [])
    # an invalid block stays content; an unterminated complete one is a call
    content, calls = parse_hermes("<tool_call>{oops}</tool_call>")
    assert calls == [] and content == "<tool_call>{oops}</tool_call>"
    content, calls = parse_hermes('<tool_call>\n{"name": "f", "arguments": {}}')
    assert content is None and [_fn(c) for c in calls] == [("f", {})]


def test_parse_required_arrays():
    calls = parse_required('[{"name": "f", "parameters": {"x": 1}}, {"name": "g", '
                           '"parameters": {}}]')
    assert [_fn(c) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert parse_required('[{"name": "f", "parameters"') is None
    assert parse_required('{"name": "f"}') is None


def test_required_array_cut_by_length_keeps_complete_calls_as_a_stream_does():
    cut = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {"y"'
    content, calls, finish = ToolOutput("required").message(cut, "length")
    assert content is None and finish == "length"
    assert [_fn(c) for c in calls] == [("f", {"x": 1})]
    assert [(n, a) for n, a in _stream(ToolOutput("required"), cut, 7)[1]] == [("f", {"x": 1})]
    # nothing complete: the text stays content
    assert ToolOutput("required").message('[{"name": "f"', "length") == (
        '[{"name": "f"', [], "length")


def _stream(out: ToolOutput, text: str, step: int) -> tuple[str, list[tuple[str, dict]]]:
    """Feed ``text`` in pieces of ``step`` characters; the content and calls the deltas
    describe, assembled as a client does."""
    st = out.streamer()
    deltas = []
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for i, p in enumerate(pieces):
        deltas += st.feed(p, final=i == len(pieces) - 1)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            if "id" in tc:
                assert tc["id"].startswith("call_") and tc["type"] == "function"
            f = tc.get("function", {})
            c["name"] += f.get("name") or ""
            c["arguments"] += f.get("arguments") or ""
    return content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_hermes_matches_whole(step):
    content, calls = _stream(ToolOutput("auto"), HERMES, step)
    whole_content, whole_calls = parse_hermes(HERMES)
    assert content.strip() == whole_content.strip()
    assert calls == [_fn(c) for c in whole_calls]
    assert "<tool" not in content  # a partial "<tool_call>" is never sent as content
    text = "a < b and <tool but not a call"
    assert _stream(ToolOutput("auto"), text, step) == (text, [])


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_parallel_tool_calls_false_keeps_the_first_auto_call(step):
    one = ToolOutput("auto", parallel=False)
    _, calls, finish = one.message(HERMES, "stop")
    assert [_fn(c) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert _stream(one, HERMES, step)[1] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_streamed_required_and_named(step):
    arr = '[{"name": "f", "parameters": {"x": [1, 2]}}, {"name": "g", "parameters": {}}]'
    assert _stream(ToolOutput("required"), arr, step) == ("", [("f", {"x": [1, 2]}),
                                                               ("g", {})])
    assert _stream(ToolOutput("named", "f"), '{"x": 3}', step) == ("", [("f", {"x": 3})])


def test_finished_messages_and_finish_reasons():
    auto = ToolOutput("auto")
    content, calls, finish = auto.message(HERMES, "stop")
    assert len(calls) == 2 and finish == "tool_calls"
    assert auto.message("hello", "stop") == ("hello", [], "stop")
    req = ToolOutput("required")
    _, calls, finish = req.message('[{"name": "f", "parameters": {}}]', "stop")
    assert finish == "tool_calls" and [_fn(c) for c in calls] == [("f", {})]
    assert req.message('[{"name": "f"', "length") == ('[{"name": "f"', [], "length")
    named = ToolOutput("named", "f")
    content, calls, finish = named.message('{"x": 1}', "stop")
    assert content is None and finish == "stop" and [_fn(c) for c in calls] == [("f", {"x": 1})]


# -- the prompt -------------------------------------------------------------------------------------


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "weather in Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": TOOLS, **kw})


def test_template_without_tools_gets_hermes_instructions_and_history(tok):
    ft = FrontendTokenizer(tok)
    req = _req()
    msgs = [m.to_template() for m in req.messages]
    tp = tool_prompt(req, ft, msgs, {})
    assert not tp.native and tp.hermes and tp.template_tools is None
    text = ft.chat_prompt(tp.messages, True)
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    none = tool_prompt(_req(tool_choice="none"), ft, msgs, {})
    assert not none.hermes and "<tools>" not in ft.chat_prompt(none.messages, True)


#: A minimal template that renders tools natively, Hermes-style (the shape Qwen2.5 uses).
NATIVE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}"
          "{% endfor %}\nCall them as <tool_call>{...}</tool_call><|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
OTHER = NATIVE.replace("<tool_call>{...}</tool_call>", "[CALL]...")


def test_template_with_tools_renders_them_itself(tok):
    ft = FrontendTokenizer(tok)
    req = _req()
    msgs = [m.to_template() for m in req.messages]
    tp = tool_prompt(req, ft, msgs, {"chat_template": NATIVE})
    assert tp.native and tp.hermes and tp.template_tools and tp.messages == msgs
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    with pytest.raises(OpenAIError) as e:  # another call format: "auto" cannot be parsed
        tool_prompt(req, ft, msgs, {"chat_template": OTHER})
    assert e.value.param == "tool_choice"
    assert tool_prompt(_req(tool_choice="required"), ft, msgs, {"chat_template": OTHER}).native
