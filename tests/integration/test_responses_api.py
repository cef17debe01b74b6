"""``POST /v1/responses`` (OpenAI's Responses API) against the shared real server, through the
official ``openai`` package: text and message input, ``instructions``, ``max_output_tokens``
(status incomplete), streaming events in OpenAI's order, function calls (forced, required and
parsed Hermes calls after ``function_call`` / ``function_call_output`` input items),
``text.format`` structured output, and 400s naming the fields radixserve does not serve."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from pydantic import BaseModel

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "Rome", "Lima"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
           "parameters": WEATHER_PARAMS}
TIME = {"type": "function", "name": "get_time", "description": "Local time of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                  "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME["parameters"]}
#: the event types of a streamed text response, in OpenAI's order (deltas collapsed)
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done",
               "response.output_item.done"]


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=180, max_retries=0)


def _collapsed(types: list[str]) -> list[str]:
    """Event types with runs of the same delta type collapsed to one."""
    out: list[str] = []
    for t in types:
        if not (out and out[-1] == t and t.endswith(".delta")):
            out.append(t)
    return out


def _calls(response) -> list[tuple[str, str]]:
    return [(o.name, o.arguments) for o in response.output if o.type == "function_call"]


# -- text ------------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_text_input_matches_chat_and_counts_tokens(client: OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="What is the capital of France?",
                                temperature=0, max_output_tokens=40)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    (part,) = msg.content
    assert part.type == "output_text" and part.text and r.output_text == part.text
    # the same conversation through chat: the same greedy text and token counts
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_completion_tokens=40)
    assert part.text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert (r.status == "incomplete") == (chat.choices[0].finish_reason == "length")


@pytest.mark.timeout(180)
def test_message_input_with_instructions(server, client: OpenAI) -> None:
    instructions = "You are a pirate. Answer in one short sentence."
    ask = "Where do you keep your treasure?"
    r = client.responses.create(
        model=MODEL, instructions=instructions, temperature=0, max_output_tokens=30,
        input=[{"role": "user", "content": [{"type": "input_text", "text": ask}]}])
    assert r.instructions == instructions and r.output_text
    # the instructions are the system message before the input
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": ask}]
    tok = httpx.post(server.base_url + "/tokenize", json={"messages": messages},
                     timeout=60).json()
    assert r.usage.input_tokens == tok["count"]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_completion_tokens=30)
    assert r.output_text == chat.choices[0].message.content
    # an earlier assistant turn given back as output_text is part of the conversation
    follow = client.responses.create(model=MODEL, temperature=0, max_output_tokens=10, input=[
        {"role": "user", "content": ask},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": r.output_text}]},
        {"role": "user", "content": "Say it again."}])
    assert follow.usage.input_tokens > r.usage.input_tokens


@pytest.mark.timeout(120)
def test_max_output_tokens_gives_status_incomplete(client: OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Tell me a long story about a dragon.",
                                max_output_tokens=5, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.max_output_tokens == 5
    assert r.output[-1].status == "incomplete" and r.output_text


# -- streaming -------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_stream_events_in_order_and_equal_to_unstreamed(client: OpenAI) -> None:
    kw = dict(model=MODEL, input="Say hello to the world in one short sentence.",
              temperature=0, max_output_tokens=60)
    whole = client.responses.create(**kw)
    assert whole.status == "completed", whole  # the stream's final event is response.completed
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert _collapsed(types) == [*TEXT_EVENTS, "response.completed"], types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == final.output_text
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.id == final.output[0].id and final.id == events[0].response.id
    assert events[0].response.status == "in_progress" and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.timeout(120)
def test_stream_cut_by_max_output_tokens_ends_with_response_incomplete(client: OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Tell me a long story.",
                                          max_output_tokens=4, temperature=0, stream=True))
    types = [e.type for e in events]
    assert _collapsed(types) == [*TEXT_EVENTS, "response.incomplete"], types
    last = events[-1].response
    assert last.status == "incomplete" and last.incomplete_details.reason == "max_output_tokens"
    assert last.usage.output_tokens == 4 and last.output[0].status == "incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == last.output[0].content[0].text


# -- tools -----------------------------------------------------------------------------------------


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.timeout(240)
def test_forced_and_required_function_calls(client: OpenAI) -> None:
    ask = "What's the weather and time in Paris?"
    named = client.responses.create(model=MODEL, input=ask, tools=[WEATHER, TIME],
                                    tool_choice={"type": "function", "name": "get_time"},
                                    max_output_tokens=50, temperature=0)
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_time"
    assert call.call_id.startswith("call_") and call.status == "completed"
    _check_call(call.name, call.arguments)
    assert named.tool_choice.name == "get_time" and len(named.tools) == 2
    one = client.responses.create(model=MODEL, input=ask, tools=[WEATHER, TIME],
                                  tool_choice="required", parallel_tool_calls=False,
                                  max_output_tokens=60, temperature=0)
    assert one.status == "completed" and len(_calls(one)) == 1
    assert all(o.type == "function_call" for o in one.output)
    _check_call(*_calls(one)[0])
    none = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="none",
                                   max_output_tokens=8, temperature=0)
    assert not _calls(none) and none.output_text


@pytest.mark.timeout(240)
def test_streamed_function_call_equals_unstreamed(client: OpenAI) -> None:
    kw = dict(model=MODEL, input="What's the weather in Rome?", tools=[WEATHER],
              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
              temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = _collapsed([e.type for e in events])
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"], types
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert _calls(final) == _calls(whole) == [("get_weather", args)]
    _check_call("get_weather", args)


#: earlier turns showing the model the call format, as Responses input items: the call it
#: made and its result (SmolLM2's template has no tool support; the chat path writes the
#: tools and these turns in Hermes form into the prompt)
FEW_SHOT: list[dict] = []
for _city in ("London", "Berlin", "Madrid"):
    FEW_SHOT += [{"role": "user", "content": f"What's the weather in {_city}?"},
                 {"type": "function_call", "call_id": f"c{_city}", "name": "get_weather",
                  "arguments": json.dumps({"city": _city, "unit": "celsius"})},
                 {"type": "function_call_output", "call_id": f"c{_city}", "output": "sunny"},
                 {"role": "assistant", "content": f"It is sunny in {_city}."}]


@pytest.mark.timeout(240)
def test_auto_parses_calls_after_function_call_items_like_chat(client: OpenAI) -> None:
    ask = {"role": "user", "content": "What's the weather in Paris?"}
    kw = dict(model=MODEL, input=[*FEW_SHOT, ask], tools=[WEATHER], max_output_tokens=60,
              temperature=0)
    whole = client.responses.create(**kw)
    assert whole.tool_choice == "auto"
    ((name, arguments),) = _calls(whole)
    assert name == "get_weather" and json.loads(arguments)["city"] == "Paris"
    # the same conversation as chat messages: the same call
    messages = []
    for m in FEW_SHOT:
        if m.get("type") == "function_call":
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": m["call_id"], "type": "function",
                 "function": {"name": m["name"], "arguments": m["arguments"]}}]})
        elif m.get("type") == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": m["call_id"],
                             "content": m["output"]})
        else:
            messages.append(m)
    chat = client.chat.completions.create(
        model=MODEL, messages=[*messages, ask], temperature=0, max_completion_tokens=60,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                 if k != "type"}}])
    (tc,) = chat.choices[0].message.tool_calls
    assert (tc.function.name, tc.function.arguments) == (name, arguments)
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert _calls(final) == [(name, arguments)]


# -- structured output -----------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_text_format_json_schema_and_json_object(client: OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(model=MODEL, input="Describe a fictional person as JSON.",
                                text={"format": fmt}, max_output_tokens=80, temperature=0)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    sampled = client.responses.create(model=MODEL, input="Describe a fictional person as JSON.",
                                      text={"format": fmt}, max_output_tokens=80,
                                      temperature=1.0, extra_body={"seed": 3})
    jsonschema.validate(json.loads(sampled.output_text), PERSON)
    parsed = client.responses.parse(model=MODEL, input="Describe a fictional person.",
                                    text_format=Person, max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, Person)
    obj = client.responses.create(
        model=MODEL, input="Reply with a JSON object with the keys name and age.",
        text={"format": {"type": "json_object"}}, max_output_tokens=80, temperature=0)
    assert isinstance(json.loads(obj.output_text), dict)


# -- refused ---------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_unsupported_fields_are_400s_naming_them(client: OpenAI) -> None:
    cases = [(dict(background=True), "background"),
             (dict(previous_response_id="resp_123"), "previous_response_id"),
             (dict(store=True), "store"),
             (dict(extra_body={"reasoning": {"effort": "high"}}), "reasoning"),
             (dict(extra_body={"frobnicate": 1}), "frobnicate"),
             (dict(max_output_tokens=0), "max_output_tokens"),
             (dict(text={"format": {"type": "json_schema", "name": "x",
                                    "schema": {"type": "nope"}}}), "text.format"),
             (dict(tools=[{"type": "web_search"}]), "tools.0.type"),
             (dict(tool_choice={"type": "function", "name": "nope"}, tools=[WEATHER]),
              "tool_choice")]
    for kw, param in cases:
        with pytest.raises(BadRequestError) as e:
            client.responses.create(model=MODEL, input="Hi", **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")
    assert "input" in e.value.body["message"]  # says what to do instead
    # the values that change nothing are accepted
    r = client.responses.create(model=MODEL, input="Hi", store=False, background=False,
                                max_output_tokens=2, metadata={"k": "v"}, user="u")
    assert r.store is False and r.metadata == {"k": "v"}
