"""The per-family tool-call parsers (``--tool-call-parser``: hermes, llama3_json, mistral,
pythonic) on hand-written model outputs in each family's format: the whole message, and the
streamed deltas fed in every split, which must describe the same content and calls; what is
not a call stays content; and how a server with a parser treats "auto"."""

from __future__ import annotations

import json
import re

import pytest

from radixserve.config import TOOL_CALL_PARSERS, ServerConfig
from radixserve.entrypoints.openai.errors import OpenAIError
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest
from radixserve.entrypoints.openai.tool_calls import (
    AUTO_NEEDS_FLAGS,
    ToolOutput,
    get_tool_call_parser,
    parse_pythonic,
    tool_prompt,
)
from radixserve.entrypoints.openai.tool_calls import (
    TOOL_CALL_PARSERS as PARSER_CLASSES,
)
from radixserve.frontend.tokenizer import FrontendTokenizer

PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
ROME = ("get_time", {"city": "Rome"})

#: parser -> [(model output, expected content or None, expected calls)]
CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
         '"celsius"}}\n</tool_call>', None, [PARIS]),
        ("Sure.\n<tool_call>{\"name\": \"get_time\", \"arguments\": {\"city\": \"Rome\"}}"
         "</tool_call>", "Sure.\n", [ROME]),
        ("No tools needed.", "No tools needed.", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
         None, [PARIS]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
         '"celsius"}}; {"name": "get_time", "arguments": {"city": "Rome"}}', None,
         [PARIS, ROME]),
        ("  The weather is {sunny} today.", "  The weather is {sunny} today.", []),
        ('{"city": "Paris"} is not a call', '{"city": "Paris"} is not a call', []),
        # the marker deleted by skip_special_tokens
        ('{"name": "get_time", "parameters": {"city": "Rome"}}', None, [ROME]),
        ("Paris is sunny.", "Paris is sunny.", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
         '"celsius"}}, {"name": "get_time", "arguments": {"city": "Rome"}}]', None,
         [PARIS, ROME]),
        ('Let me look.[TOOL_CALLS] [{"name": "get_time", "arguments": {"city": "Rome"}}]',
         "Let me look.", [ROME]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
         '[TOOL_CALLS]get_time{"city": "Rome"}', None, [PARIS, ROME]),
        ("[TOOL] is a word, TOOL_CALLS too.", "[TOOL] is a word, TOOL_CALLS too.", []),
        # the marker deleted by skip_special_tokens: a leading list of calls
        (' [ {"name": "get_time", "arguments": {"city": "Rome"}}]', None, [ROME]),
        ("[1, 2] is a list.", "[1, 2] is a list.", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="celsius"), get_time(city="Rome")]', None,
         [PARIS, ROME]),
        ("<|python_start|>[get_time(city='Rome')]<|python_end|>", None, [ROME]),
        ('[get_weather(city="Pa]ris", unit="celsius")]', None,
         [("get_weather", {"city": "Pa]ris", "unit": "celsius"})]),
        ("[1, 2] is a list.", "[1, 2] is a list.", []),
        ("Nothing to call.", "Nothing to call.", []),
    ],
}


def _fn(call: dict) -> tuple[str, dict]:
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def _stream(out: ToolOutput, text: str, step: int) -> tuple[str, list[tuple[str, dict]],
                                                             list[str]]:
    """Feed ``text`` in pieces of ``step`` characters; (content, calls, ids) as a client
    assembles the deltas."""
    st = out.streamer()
    deltas = []
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for i, p in enumerate(pieces):
        deltas += st.feed(p, final=i == len(pieces) - 1)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    ids = []
    for d in deltas:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            if "id" in tc:
                ids.append(tc["id"])
                assert tc["type"] == "function"
            f = tc.get("function", {})
            c["name"] += f.get("name") or ""
            c["arguments"] += f.get("arguments") or ""
    return (content, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
            ids)


def test_every_cli_parser_name_has_a_parser():
    assert set(TOOL_CALL_PARSERS) == set(PARSER_CLASSES)
    with pytest.raises(ValueError, match="llama3_json"):
        get_tool_call_parser("nope")


@pytest.mark.parametrize("name", list(CASES))
def test_whole_output(name):
    parser = get_tool_call_parser(name)
    for text, content, calls in CASES[name]:
        got_content, got_calls = parser.parse(text)
        assert [_fn(c) for c in got_calls] == calls, text
        assert (got_content if got_content is None else got_content) == content, text
        out = ToolOutput("auto", parser=parser)
        _, msg_calls, finish = out.message(text, "stop")
        assert finish == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 1000])
@pytest.mark.parametrize("name", list(CASES))
def test_streamed_matches_whole(name, step):
    parser = get_tool_call_parser(name)
    for text, content, calls in CASES[name]:
        got_content, got_calls, ids = _stream(ToolOutput("auto", parser=parser), text, step)
        assert got_calls == calls, (text, step)
        assert got_content.strip() == (content or "").strip(), (text, step)
        for marker in ("<tool_call", "[TOOL_CALLS", "<|python_tag", "<|python_start"):
            if calls:
                assert marker not in got_content


def test_mistral_ids_are_nine_alphanumerics():
    parser = get_tool_call_parser("mistral")
    _, calls = parser.parse(CASES["mistral"][0][0])
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in calls)
    _, _, ids = _stream(ToolOutput("auto", parser=parser), CASES["mistral"][2][0], 4)
    assert len(ids) == 2 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)


def test_parallel_false_keeps_the_first_call():
    for name in ("llama3_json", "mistral", "pythonic"):
        out = ToolOutput("auto", parallel=False, parser=get_tool_call_parser(name))
        text = next(t for t, _, calls in CASES[name] if len(calls) == 2)
        assert [_fn(c) for c in out.message(text, "stop")[1]] == [PARIS]
        assert _stream(out, text, 3)[1] == [PARIS]


def test_cut_calls_stay_content_or_keep_the_complete_ones():
    llama = ToolOutput("auto", parser=get_tool_call_parser("llama3_json"))
    cut = '{"name": "get_time", "parameters": {"city": "Ro'
    assert llama.message(cut, "length") == (cut, [], "length")
    assert _stream(llama, cut, 4)[:2] == (cut, [])
    py = ToolOutput("auto", parser=get_tool_call_parser("pythonic"))
    assert py.message('[get_time(city="Ro', "length")[1] == []
    assert parse_pythonic("[get_time(city=x)]") is None  # a name is no literal


# -- the prompt ---------------------------------------------------------------------------------


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}]


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "weather in Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function",
                          "function": {"name": "get_weather",
                                       "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": TOOLS, **kw})


def test_a_parser_without_auto_tool_choice_refuses_auto_as_vllm(tok):
    ft = FrontendTokenizer(tok)
    req = _req()
    msgs = [m.to_template() for m in req.messages]
    with pytest.raises(OpenAIError) as e:
        tool_prompt(req, ft, msgs, {}, "llama3_json", auto_tool_choice=False)
    assert e.value.param == "tool_choice" and e.value.message == AUTO_NEEDS_FLAGS
    # "required" and named calls are constrained: no parser needed
    assert not tool_prompt(_req(tool_choice="required"), ft, msgs, {}, "llama3_json").hermes
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        ServerConfig(enable_auto_tool_choice=True)


def test_template_without_tools_gets_the_parsers_format(tok):
    ft = FrontendTokenizer(tok)
    req = _req()
    msgs = [m.to_template() for m in req.messages]
    for name, call_text in (
            ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
            ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
                        '"Paris"}}]'),
            ("pythonic", "[get_weather(city='Paris')]")):
        tp = tool_prompt(req, ft, msgs, {}, name, auto_tool_choice=True)
        assert tp.hermes and tp.parser.name == name and not tp.native
        text = ft.chat_prompt(tp.messages, True)
        assert call_text in text, name
        assert "<tool_call>" not in text


#: A Llama 3.1-style template that renders tools itself (the JSON-call instructions).
LLAMA3 = ("{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
          'Respond with a JSON object {"name": function name, "parameters": dict}.'
          "{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|eot_id|>{% endif %}"
          "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
          "{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
          "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def test_native_template_of_another_format_is_parsed_with_its_parser(tok):
    ft = FrontendTokenizer(tok)
    req = _req()
    msgs = [m.to_template() for m in req.messages]
    with pytest.raises(OpenAIError):  # no parser named: Hermes cannot read it
        tool_prompt(req, ft, msgs, {"chat_template": LLAMA3})
    tp = tool_prompt(req, ft, msgs, {"chat_template": LLAMA3}, "llama3_json", True)
    assert tp.native and tp.hermes and tp.parser.name == "llama3_json"
