"""The Responses API body: validation under its own field names, its translation into the chat
request, and chat-path errors renamed to the Responses fields."""

from __future__ import annotations

import json
import math

import pytest
from pydantic import ValidationError

from radixserve.entrypoints.openai.errors import OpenAIError, error_from_validation
from radixserve.entrypoints.openai.protocol_responses import ResponsesRequest
from radixserve.entrypoints.openai.serving_responses import _responses_error

TOOL = {"type": "function", "name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def parse(**kw) -> ResponsesRequest:
    req = ResponsesRequest.model_validate({"input": "hi", **kw})
    req.check()
    return req


def param_of(**kw) -> str | None:
    try:
        parse(**kw)
    except OpenAIError as e:
        return e.param
    except ValidationError as e:
        return error_from_validation(e).param
    raise AssertionError(f"{kw} was accepted")


def test_string_input_and_instructions_become_chat_messages():
    chat = parse(instructions="be brief", max_output_tokens=7, temperature=0.5).to_chat_request()
    assert [m.to_template() for m in chat.messages] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat.max_completion_tokens == 7 and chat.temperature == 0.5
    assert "temperature" in chat.model_fields_set and "top_p" not in chat.model_fields_set


def test_items_become_messages_with_tool_calls_and_results():
    req = parse(input=[
        {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "calling"}], "id": "msg_1",
         "status": "completed"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
    ])
    msgs = req.messages()
    assert msgs[0] == {"role": "user", "content": "ab"}
    # the text and both calls of the assistant turn are one message
    assert msgs[1]["role"] == "assistant" and msgs[1]["content"] == "calling"
    assert [c["id"] for c in msgs[1]["tool_calls"]] == ["c1", "c2"]
    assert msgs[2:] == [{"role": "tool", "tool_call_id": "c1", "content": "one"},
                        {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    chat = req.to_chat_request()
    assert chat.messages[1].to_template()["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    # a call with no text before it is an assistant message of its own
    alone = parse(input=[{"role": "user", "content": "q"},
                         {"type": "function_call", "call_id": "c", "name": "f",
                          "arguments": "{}"}]).messages()
    assert alone[1]["role"] == "assistant" and alone[1]["content"] is None


def test_tools_choice_and_text_format_become_the_chat_ones():
    chat = parse(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
                 parallel_tool_calls=False).to_chat_request()
    assert chat.tools[0].function.name == "get_weather"
    assert chat.tools[0].function.parameters == TOOL["parameters"]
    assert chat.tool_choice.function.name == "get_weather" and not chat.parallel_tool_calls
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse(text={"format": {"type": "json_schema", "name": "n", "schema": schema,
                                 "strict": True}})
    rf = req.to_chat_request().response_format
    assert rf.type == "json_schema" and rf.json_schema.json_schema == schema
    assert rf.json_schema.name == "n" and rf.json_schema.strict is True
    assert req.text.format.echo() == {"type": "json_schema", "name": "n", "schema": schema,
                                      "strict": True}
    assert parse(text={"format": {"type": "json_object"}}).to_chat_request(
    ).response_format.type == "json_object"
    assert parse(tools=[]).to_chat_request().tools is None  # an empty list is no tools


def test_stored_response_features_and_unknown_fields_are_refused_by_name():
    assert param_of(background=True) == "background"
    assert param_of(previous_response_id="resp_1") == "previous_response_id"
    assert param_of(store=True) == "store"
    assert param_of(conversation="conv_1") == "conversation"
    assert param_of(reasoning={"effort": "low"}) == "reasoning"
    assert param_of(truncation="auto") == "truncation"
    assert param_of(include=["message.output_text.logprobs"]) == "include"
    assert param_of(text={"verbosity": "low"}) == "text.verbosity"
    assert param_of(stream=True, stream_options={"include_obfuscation": True}) == (
        "stream_options.include_obfuscation")
    assert param_of(frobnicate=1) == "frobnicate"
    with pytest.raises(OpenAIError) as e:
        parse(previous_response_id="r", background=True)
    assert e.value.param == "background" and "previous_response_id" in e.value.message
    # the values that change nothing, and bookkeeping, are accepted; null is "not set"
    parse(store=False, background=False, truncation="disabled", include=[], top_logprobs=0,
          text={"verbosity": "medium"}, user="u", metadata={"k": "v"}, service_tier="auto",
          previous_response_id=None, reasoning=None)


def test_bad_values_name_the_responses_field():
    assert param_of(input=[]) == "input"
    assert param_of(input=[{"type": "reasoning"}]) == "input.0.type"
    assert param_of(input=[{"role": "user", "content": [{"type": "input_image"}]}]) == (
        "input.0.content.0.type")
    assert param_of(input=[{"role": "robot", "content": "x"}]) == "input.0.role"
    assert param_of(input=[{"type": "function_call", "name": "f"}]) == "input.0"
    assert param_of(input=[{"type": "function_call_output", "call_id": "c",
                            "output": "x"}]) == "input.0"
    assert param_of(tools=[{"type": "web_search"}]) == "tools.0.type"
    assert param_of(tools=[{**TOOL, "name": ""}]) == "tools.0.name"
    assert param_of(tool_choice="required") == "tool_choice"
    assert param_of(tools=[TOOL], tool_choice={"type": "function", "name": "x"}) == (
        "tool_choice")
    assert param_of(text={"format": {"type": "json_schema", "name": "n"}}) == "text.format"
    assert param_of(stream_options={"include_obfuscation": False}) == "stream_options"
    assert param_of(instructions="\ud800") == "instructions"
    assert param_of(user="\udfff") == "user"
    assert param_of(metadata={"k": math.nan}) == "metadata"
    assert param_of(tools=[{**TOOL, "parameters": {"maximum": math.inf}}]) == "tools"


def test_chat_errors_are_renamed_to_responses_fields():
    e = _responses_error(OpenAIError("max_tokens=0 must be in [1, 2147483647]",
                                     param="max_tokens"))
    assert e.param == "max_output_tokens" and e.message.startswith("max_output_tokens=0")
    e = _responses_error(OpenAIError("response_format: invalid JSON schema",
                                     param="response_format"))
    assert e.param == "text.format" and e.message.startswith("text.format:")
    e = _responses_error(OpenAIError("bad", param="tools.1.function.parameters"))
    assert e.param == "tools.1.parameters"
    e = _responses_error(OpenAIError("too long", param="messages", code="x"))
    assert (e.param, e.code, e.status_code) == ("input", "x", 400)
    assert _responses_error(OpenAIError("kept", param="max_output_tokens")).param == (
        "max_output_tokens")
    assert json.dumps(_responses_error(OpenAIError("m")).to_dict())
