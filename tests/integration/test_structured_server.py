"""Structured outputs, tool calls and the vLLM request fields against the shared real server,
through the official ``openai`` package: every constrained output parses and validates
(``jsonschema``), greedy or sampled, streamed or not; bad constraints and unsupported fields
are 400s naming them; ``logit_bias`` really moves the greedy choice."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from pydantic import BaseModel

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a fictional person as JSON."}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "Rome", "Lima"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                              "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"],
           "get_time": TIME["function"]["parameters"]}


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=180, max_retries=0)


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                    "strict": True}}


# -- structured outputs ------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_parse_with_a_pydantic_model(client: OpenAI) -> None:
    r = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person,
                                      max_tokens=60, temperature=0)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person) and r.choices[0].finish_reason == "stop"
    assert Person.model_validate_json(r.choices[0].message.content) == parsed


@pytest.mark.timeout(240)
def test_json_schema_valid_for_every_sample_streamed_or_not(client: OpenAI) -> None:
    for n, temperature, seed in ((1, 0.0, None), (3, 1.0, 7)):
        r = client.chat.completions.create(model=MODEL, messages=ASK, n=n, max_tokens=100,
                                           temperature=temperature, seed=seed,
                                           response_format=_json_schema(PERSON))
        for c in r.choices:
            assert c.finish_reason == "stop", c.message.content
            jsonschema.validate(json.loads(c.message.content), PERSON)
    texts: dict[int, str] = {}
    for ch in client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=100,
                                             temperature=1.0, seed=3, stream=True,
                                             response_format=_json_schema(PERSON)):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert len(texts) == 1
    for t in texts.values():
        jsonschema.validate(json.loads(t), PERSON)


@pytest.mark.timeout(240)
def test_json_object_regex_choice_grammar(client: OpenAI) -> None:
    short = [{"role": "user", "content": "Reply with a JSON object with the keys name and age "
                                         "of a fictional person."}]
    r = client.chat.completions.create(model=MODEL, messages=short, max_tokens=100,
                                       temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    cases = [({"regex": r"[A-Z][a-z]{2,8}-[0-9]{3}"},
              lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}-[0-9]{3}", t)),
             ({"choice": ["Paris", "London", "Madrid"]},
              lambda t: t in ("Paris", "London", "Madrid")),
             ({"grammar": 'root ::= ("yes" | "no") ", because " [a-z ]{1,20} "."'},
              lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", t)),
             ({"json": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                    "maximum": 99},
                        "minItems": 2, "maxItems": 4}},
              lambda t: 2 <= len(json.loads(t)) <= 4 and all(0 <= x <= 99
                                                            for x in json.loads(t)))]
    for constraint, ok in cases:
        r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      n=2, max_tokens=30, temperature=1.0, seed=5,
                                      extra_body={"structured_outputs": constraint})
        for c in r.choices:
            assert c.finish_reason == "stop" and ok(c.text), (constraint, c.text)
    # vLLM's older field name
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=5,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("body,param,words", [
    ({"response_format": _json_schema({"type": "objec"})}, "response_format", "objec"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": 'root ::= "a" |'}}, "structured_outputs", "grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "only one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
])
def test_bad_constraints_are_400s_naming_them(server, body, param, words) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"messages": ASK, "max_tokens": 5, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and words in err["message"], err
    assert httpx.get(server.base_url + "/health").status_code == 200


# -- fields: nothing silently ignored ------------------------------------------------------------


@pytest.mark.timeout(120)
def test_unsupported_fields_refused_no_op_fields_accepted(server, client: OpenAI) -> None:
    for body, param in (({"whatever": {"x": 1}}, "whatever"), ({"functions": [{"name": "f"}]},
                                                               "functions"),
                        ({"reasoning_effort": "high"}, "reasoning_effort"),
                        ({"use_beam_search": True}, "use_beam_search")):
        with pytest.raises(BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                           extra_body=body)
        assert e.value.body["param"] == param
    for body, param in (({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of")):
        r = httpx.post(server.base_url + "/v1/completions",
                       json={"prompt": "Hi", "max_tokens": 2, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_completion_tokens=3, user="u", store=False,
        metadata={"k": "v"}, service_tier="auto", temperature=0,
        extra_body={"reasoning_effort": None, "request_id": "abc"})
    assert r.usage.completion_tokens == 3


@pytest.mark.timeout(120)
def test_logit_bias_moves_greedy_output_and_is_validated(server, client: OpenAI) -> None:
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    target = httpx.post(server.base_url + "/tokenize",
                        json={"prompt": " banana"}).json()["tokens"][0]
    biased = client.completions.create(**kw, logit_bias={str(target): 100})
    assert biased.choices[0].text != plain and "banana" in biased.choices[0].text
    vocab_out = 10**7
    for bias, words in (({str(vocab_out): 5}, "token id"), ({str(target): 101}, "[-100, 100]")):
        with pytest.raises(BadRequestError) as e:
            client.completions.create(**kw, logit_bias=bias)
        assert e.value.body["param"] == "logit_bias" and words in e.value.body["message"]


# -- tool calls ------------------------------------------------------------------------------------------


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.timeout(240)
def test_tool_choice_required_named_and_parallel(client: OpenAI) -> None:
    msgs = [{"role": "user", "content": "What's the weather and time in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                       tool_choice="required", max_tokens=100, temperature=0)
    ch = r.choices[0]
    assert ch.message.tool_calls and ch.message.content is None
    # a parallel array is closed by the model or cut by max_tokens (SmolLM2 repeats calls);
    # either way the complete calls are returned
    assert ch.finish_reason == "tool_calls" or (
        ch.finish_reason == "length" and r.usage.completion_tokens == 100)
    for call in ch.message.tool_calls:
        assert call.type == "function" and call.id
        _check_call(call.function.name, call.function.arguments)
    one = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME],
                                         tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=60, temperature=0.9, seed=2)
    assert len(one.choices[0].message.tool_calls) == 1
    assert one.choices[0].finish_reason == "tool_calls"  # a one-item array is closed
    named = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=[WEATHER, TIME], max_tokens=50, temperature=1.0,
        seed=4, tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and named.choices[0].finish_reason == "stop"
    _check_call("get_time", call.function.arguments)
    none = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER],
                                          tool_choice="none", max_tokens=8, temperature=0)
    assert not none.choices[0].message.tool_calls and none.choices[0].message.content


def _stream_calls(client: OpenAI, **kw) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) assembled from streamed deltas."""
    content, calls, finish = "", {}, None
    for ch in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for c in ch.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, ["", ""])
                if tc.function and tc.function.name:
                    slot[0] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot[1] += tc.function.arguments
            finish = c.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.timeout(300)
def test_streamed_tool_calls_equal_non_streamed(client: OpenAI) -> None:
    msgs = [{"role": "user", "content": "What's the weather in Rome?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel in (("required", False), (named, False), ("required", True)):
        kw = dict(messages=msgs, tools=[WEATHER], tool_choice=choice, max_tokens=60,
                  temperature=0, parallel_tool_calls=parallel)
        whole = client.chat.completions.create(model=MODEL, **kw).choices[0]
        content, calls, finish = _stream_calls(client, **kw)
        assert finish == whole.finish_reason and not content
        assert calls == [(c.function.name, c.function.arguments)
                         for c in whole.message.tool_calls]
        for name, args in calls:
            _check_call(name, args)


#: Earlier turns that show the model the Hermes call format (SmolLM2's template has no tool
#: support: radixserve writes the tools and these turns in Hermes form into the prompt).
FEW_SHOT = []
for _city in ("London", "Berlin", "Madrid"):
    FEW_SHOT += [{"role": "user", "content": f"What's the weather in {_city}?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{_city}", "type": "function", "function": {
                         "name": "get_weather",
                         "arguments": json.dumps({"city": _city, "unit": "celsius"})}}]},
                 {"role": "tool", "tool_call_id": f"c{_city}", "content": "sunny"},
                 {"role": "assistant", "content": f"It is sunny in {_city}."}]


@pytest.mark.timeout(240)
def test_auto_parses_hermes_tool_calls_streamed_or_not(client: OpenAI) -> None:
    kw = dict(messages=[*FEW_SHOT, {"role": "user", "content": "What's the weather in Paris?"}],
              tools=[WEATHER], max_tokens=60, temperature=0)
    whole = client.chat.completions.create(model=MODEL, **kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole.message
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris"
    content, calls, finish = _stream_calls(client, **kw)
    assert finish == "tool_calls" and calls == [(call.function.name, call.function.arguments)]
    assert "<tool_call>" not in content


# -- vLLM fields ---------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_token_ids_fields_and_continuous_usage(server, client: OpenAI) -> None:
    base = server.base_url
    r = httpx.post(base + "/v1/chat/completions", json={
        "messages": ASK, "max_tokens": 4, "temperature": 0, "return_token_ids": True,
        "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True},
        timeout=60).json()
    ch = r["choices"][0]
    assert len(ch["token_ids"]) == 4 and r["prompt_token_ids"]
    assert [c["token"] for c in ch["logprobs"]["content"]] == [f"token_id:{t}"
                                                              for t in ch["token_ids"]]
    c = httpx.post(base + "/v1/completions", json={
        "prompt": "Hi", "max_tokens": 3, "return_token_ids": True}, timeout=60).json()
    assert c["choices"][0]["prompt_token_ids"] and len(c["choices"][0]["token_ids"]) == 3
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in chunks if ch.choices]
    assert all(ch.usage is not None for ch in chunks)
    assert counts == sorted(counts) and counts[-1] == 4


@pytest.mark.timeout(120)
def test_chat_echo_continue_final_message(client: OpenAI) -> None:
    msgs = [{"role": "user", "content": "Write a greeting."},
            {"role": "assistant", "content": "Hello and welcome"}]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=5, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "echo": True})
    assert r.choices[0].message.content.startswith("Hello and welcome")
    cont = r.choices[0].message.content[len("Hello and welcome"):]
    # the same continuation as a raw completion of the rendered, unterminated prompt
    prompt = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
              "Hugging Face<|im_end|>\n<|im_start|>user\nWrite a greeting.<|im_end|>\n"
              "<|im_start|>assistant\nHello and welcome")
    raw = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert cont == raw.choices[0].text
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"
