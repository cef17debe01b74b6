"""Each ``--tool-call-parser`` through the chat path without a model: the request is
templated with that family's chat template (Mistral-, Llama 3.1- and Llama 3.2/4-style
templates that render ``tools`` themselves), and a hand-written model output in the family's
format is detokenized token by token (the real tokenizer and ``IncrementalDetokenizer``) and
answered by ``ChatFormatter``, whole and as streamed chunks, which must agree."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from radixserve.entrypoints.openai.protocol import ChatCompletionRequest
from radixserve.entrypoints.openai.serving_chat import ChatFormatter
from radixserve.entrypoints.openai.tool_calls import ToolOutput, tool_prompt
from radixserve.frontend.detokenizer import IncrementalDetokenizer
from radixserve.frontend.output_processor import RequestDelta, RequestState
from radixserve.frontend.tokenizer import FrontendTokenizer
from radixserve.sampling_params import SamplingParams

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

_MSGS = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
         "{% if add_generation_prompt %}assistant: {% endif %}")
#: family -> (a chat template that renders tools its way, hand-written output, its calls)
FAMILIES = {
    "hermes": (
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
        "Call as <tool_call>{...}</tool_call>\n{% endif %}" + _MSGS,
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        "</tool_call>", "Checking.\n"),
    "llama3_json": (
        "{% if tools %}Respond with a JSON object {\"name\": function name, \"parameters\": "
        "dict}.{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n{% endif %}" + _MSGS,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', None),
    "mistral": (
        "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
        + _MSGS,
        'Let me see. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        "Let me see. "),
    "pythonic": (
        "{% if tools %}Answer with [func_name(param=value)]. Functions:{% for t in tools %}"
        "\n{{ t | tojson }}{% endfor %}\n{% endif %}" + _MSGS,
        '[get_weather(city="Oslo")]', None),
}


def _run(tok, name: str, stream: bool) -> list[dict] | dict:
    template, output, _ = FAMILIES[name]
    ft = FrontendTokenizer(tok)
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS})
    msgs = [m.to_template() for m in req.messages]
    kwargs = {"chat_template": template}
    tp = tool_prompt(req, ft, msgs, kwargs, name, auto_tool_choice=True)
    assert tp.native and tp.hermes and tp.parser.name == name
    prompt = ft.chat_prompt(tp.messages, True, tools=tp.template_tools, **kwargs)
    assert "get_weather" in prompt
    ids = tok.encode(prompt)
    state = RequestState("r", 0, ids, SamplingParams(), 0.0, IncrementalDetokenizer(tok, ids))
    fmt = ChatFormatter(SimpleNamespace(tokenizer=ft, served_model_name="m"), "chatcmpl-r", 1,
                        tools=ToolOutput.for_request(req, tp))
    out_ids = tok.encode(output, add_special_tokens=False)
    chunks = []
    for i, t in enumerate(out_ids):
        text = state.detok.add([t])
        last = i == len(out_ids) - 1
        if last:
            text += state.detok.finish()
            state.finish_reason = "stop"
        chunks += fmt.deltas(RequestDelta("r", state, text, [t],
                                          finish_reason="stop" if last else None))
    return chunks if stream else fmt.response([state])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_output_whole_and_streamed(tok, name):
    content = FAMILIES[name][2]
    whole = _run(tok, name, stream=False)["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == content
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    if name == "mistral":
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])
    chunks = _run(tok, name, stream=True)
    streamed = "".join(c["delta"].get("content") or "" for c in chunks)
    assert streamed == (content or "")
    calls = [tc for c in chunks for tc in c["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert chunks[-1]["finish_reason"] == "tool_calls"
