"""Property-based fuzzing of the request bodies of ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/responses`` against one real null-model server.

Bodies have the requests' shapes with random values: text with lone surrogates and odd code
points, numbers out of range, wrong types, big lists, nested junk, unknown fields. Whatever
comes in, the answer is never a 5xx: a success, or an OpenAI error body
(``{"error": {"message", "type", "param", "code"}}``). They are all posted on one keep-alive
connection. Afterwards the server is healthy, no request runs or waits, and once the radix
cache is flushed no KV page is in use.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_utils import (
    HANG_TIMEOUT_S,
    ServerProcess,
    metrics_values,
    wait_idle,
    wait_until,
)

#: null model (a fixed token per step, no weights) with a short context, so a request
#: without max_tokens ends soon
NULL_ARGS = ["--null-model", "--max-model-len", "256", "--num-pages", "1024"]
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
RESP = "/v1/responses"
MAX_EXAMPLES = 150
FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory):
    s = ServerProcess(NULL_ARGS, Path(tmp_path_factory.mktemp("fuzz")))
    try:
        s.wait_ready(timeout_s=180)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(srv: ServerProcess):
    """One keep-alive connection for every example (a reset shows up as a transport error)."""
    with httpx.Client(base_url=srv.base_url, timeout=HANG_TIMEOUT_S,
                      limits=httpx.Limits(max_connections=1)) as c:
        yield c


# -- strategies ----------------------------------------------------------------------------------

#: strings that have broken servers: lone surrogates (JSON ``\ud800``), NUL, BOM, RTL override,
#: astral code points, special-token text, a long run
ODD_TEXT = ["\ud800", "a\udfffb", "\udc00\ud800", "\x00", "\ufeff", "\u202e", "\U0001f600",
            "\U0010ffff", "<|im_start|>", "<|endoftext|>", "{{ 1/0 }}", "%s%n", "x" * 3000]
#: any code point, lone surrogates often (hypothesis leaves them out by default)
any_char = st.characters(exclude_categories=()) | st.characters(
    min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())
text = st.one_of(st.text(max_size=12), st.text(any_char, max_size=8), st.sampled_from(ODD_TEXT))
big_int = st.sampled_from([-1, -2**31, 2**31, 2**63, -2**63 - 1, 2**64, 10**30])
ints = st.one_of(st.integers(-3, 40), big_int)
floats = st.one_of(st.floats(-3, 3), st.sampled_from([0.0, -1e308, 1e308, math.inf, -math.inf,
                                                       math.nan, 1e-320]))
#: any JSON value, nested
junk = st.recursive(
    st.none() | st.booleans() | ints | floats | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12)
big_list = st.sampled_from([[0] * 5000, [1.5] * 5000, ["1"] * 5000, [None] * 5000,
                            [[0, 1]] * 2000, list(range(5000))])


def field(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value: mostly of its own type, sometimes any JSON or a big list."""
    return st.one_of(good, good, good, junk, big_list)


token_ids = st.lists(st.one_of(st.integers(0, 49151), big_int), min_size=0, max_size=6)
stop = st.one_of(text, st.lists(text, max_size=5), st.just(["s"] * 500))
logit_bias = st.one_of(
    st.dictionaries(st.integers(-5, 60000).map(str), floats, max_size=6),
    st.dictionaries(text, floats, max_size=3),
    st.just({str(i): 1.0 for i in range(5000)}),
)
SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "model": field(st.sampled_from(["SmolLM2-135M-Instruct", "gpt-9"]) | text),
    "max_tokens": field(st.integers(-2, 8) | big_int),
    "n": field(st.integers(-1, 4) | big_int),
    "temperature": field(floats),
    "top_p": field(floats),
    "top_k": field(ints),
    "min_p": field(floats),
    "seed": field(ints),
    "stop": field(stop),
    "stop_token_ids": field(token_ids),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(ints),
    "presence_penalty": field(floats),
    "frequency_penalty": field(floats),
    "repetition_penalty": field(floats),
    "logit_bias": field(logit_bias),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={
        "include_usage": field(st.booleans()), "continuous_usage_stats": field(st.booleans())})),
    "skip_special_tokens": field(st.booleans()),
    "include_stop_str_in_output": field(st.booleans()),
    "response_format": field(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"]) | text})),
    "request_id": field(text),
    "user": field(text),
    "prompt_logprobs": field(st.integers(-1, 3) | big_int),
    "priority": field(ints),
}
#: an unknown field (refused unless null) with any name
extra = st.dictionaries(text, junk, max_size=2)

prompt = st.one_of(text, st.lists(text, min_size=0, max_size=3), token_ids,
                   st.lists(token_ids, max_size=3), st.just(list(range(5000))))
COMPLETION = {**SAMPLING, "prompt": field(prompt), "echo": field(st.booleans()),
              "logprobs": field(st.integers(-1, 6)), "suffix": field(text),
              "best_of": field(st.integers(-1, 3)), "add_special_tokens": field(st.booleans())}

content = st.one_of(text, st.none(), st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url"]) | text, "text": field(text)}), max_size=3))
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]) | text},
    optional={"content": field(content), "name": field(text), "tool_call_id": field(text)})
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": field(text)}, optional={"description": field(text), "parameters": field(junk)})})
CHAT_FIELDS = {**SAMPLING, "messages": field(st.lists(message, min_size=0, max_size=3)),
               "max_completion_tokens": field(st.integers(-2, 8) | big_int),
               "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(-1, 25)),
               "tools": field(st.lists(tool, max_size=2)),
               "tool_choice": field(st.sampled_from(["none", "auto", "required"]) | junk),
               "add_generation_prompt": field(st.booleans()),
               "continue_final_message": field(st.booleans()), "echo": field(st.booleans())}

#: values in range, so that a body of them alone is served (the engine runs it)
valid_text = st.text(max_size=12)  # any code point but a surrogate
VALID: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just("SmolLM2-135M-Instruct"),
    "max_tokens": st.integers(1, 8),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.sampled_from([-1, 1, 5, 50]),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**63 - 1),
    "stop": valid_text | st.lists(valid_text, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100),
                                  max_size=6),
    "stream": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
VALID_COMPLETION = {**VALID, "echo": st.booleans(), "logprobs": st.integers(0, 5)}
valid_prompt = st.one_of(valid_text.filter(bool), st.lists(valid_text.filter(bool), min_size=1,
                                                             max_size=3),
                         st.lists(st.integers(0, 49151), min_size=1, max_size=6))
valid_messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": valid_text}),
    min_size=1, max_size=3).map(lambda ms: [*ms, {"role": "user", "content": "Hi"}])
VALID_CHAT = {**VALID, "max_completion_tokens": st.integers(1, 8), "logprobs": st.booleans()}


def body(required_valid: dict[str, Any], valid: dict[str, Any], wild: dict[str, Any]
         ) -> st.SearchStrategy[dict[str, Any]]:
    """Half the bodies valid but for at most one field (so most reach the engine), half with
    any number of fields of any value and unknown fields besides."""
    one_wild = st.sampled_from(sorted(wild)).flatmap(lambda k: wild[k].map(lambda v: {k: v}))
    mostly_valid = st.tuples(st.fixed_dictionaries(required_valid, optional=valid),
                             st.just({}) | one_wild).map(lambda t: {**t[0], **t[1]})
    required = {k: wild[k] for k in required_valid}
    optional = {k: v for k, v in wild.items() if k not in required_valid}
    all_wild = st.tuples(st.fixed_dictionaries(required, optional=optional), extra
                         ).map(lambda t: {**t[1], **t[0]})
    return mostly_valid | all_wild


#: Responses API items: messages (content a string or parts), function calls and outputs
input_part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text",
                                                             "input_image"]) | text,
                                    "text": field(text)})
input_item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant",
                                                    "developer"]) | text},
                          optional={"type": field(st.just("message") | text),
                                    "content": field(text | st.lists(input_part, max_size=3))}),
    st.fixed_dictionaries({"type": st.just("function_call")}, optional={
        "call_id": field(text), "name": field(text), "arguments": field(text)}),
    st.fixed_dictionaries({"type": st.just("function_call_output")}, optional={
        "call_id": field(text), "output": field(text | st.lists(input_part, max_size=2))}),
    st.fixed_dictionaries({"type": text}))
response_tool = st.fixed_dictionaries({"type": st.just("function") | text}, optional={
    "name": field(text), "description": field(text), "parameters": field(junk),
    "strict": field(st.booleans())})
text_format = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema"]) | text},
    optional={"name": field(text), "schema": field(junk | st.just({"type": "integer"})),
              "strict": field(st.booleans())})
RESPONSES_FIELDS = {
    "model": SAMPLING["model"], "temperature": SAMPLING["temperature"],
    "top_p": SAMPLING["top_p"], "top_k": SAMPLING["top_k"], "seed": SAMPLING["seed"],
    "stop": SAMPLING["stop"], "logit_bias": SAMPLING["logit_bias"],
    "request_id": SAMPLING["request_id"], "user": SAMPLING["user"],
    "input": field(text | st.lists(input_item, max_size=4)),
    "instructions": field(text),
    "max_output_tokens": field(st.integers(-2, 8) | big_int),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={
        "include_obfuscation": field(st.booleans())})),
    "tools": field(st.lists(response_tool, max_size=2)),
    "tool_choice": field(st.sampled_from(["none", "auto", "required"])
                         | st.fixed_dictionaries({"type": st.just("function"),
                                                  "name": field(text)}) | junk),
    "parallel_tool_calls": field(st.booleans()),
    "text": field(st.fixed_dictionaries({}, optional={"format": field(text_format),
                                                      "verbosity": field(text)})),
    "store": field(st.booleans()), "background": field(st.booleans()),
    "previous_response_id": field(text), "include": field(st.lists(text, max_size=2)),
    "truncation": field(st.sampled_from(["auto", "disabled"]) | text),
    "reasoning": field(junk), "metadata": field(junk),
}
valid_input = st.one_of(valid_text.filter(bool), st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer"]),
     "content": valid_text | st.lists(st.fixed_dictionaries(
         {"type": st.just("input_text"), "text": valid_text}), min_size=1, max_size=2)}),
    max_size=2).map(lambda ms: [*ms, {"role": "user", "content": "Hi"}]))
VALID_RESPONSES = {k: VALID[k] for k in ("model", "temperature", "top_p", "top_k", "seed",
                                         "stop", "logit_bias", "stream")}
VALID_RESPONSES |= {"max_output_tokens": st.integers(1, 8), "instructions": valid_text,
                    "store": st.just(False), "background": st.just(False),
                    "text": st.just({"format": {"type": "json_object"}})
                    | st.just({"format": {"type": "text"}})}

completion_body = body({"prompt": valid_prompt}, VALID_COMPLETION, COMPLETION)
chat_body = body({"messages": valid_messages}, VALID_CHAT, CHAT_FIELDS)
responses_body = body({"input": valid_input}, VALID_RESPONSES, RESPONSES_FIELDS)


# -- the checks ----------------------------------------------------------------------------------


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    """Post ``body`` (JSON with ``\\u`` escapes, lone surrogates included, and NaN/Infinity as
    Python's json writes them) and check the answer."""
    data = json.dumps(body).encode()
    r = client.post(path, content=data, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:2000], data[:2000])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, r.text
        assert isinstance(err["message"], str) and err["message"], r.text
        assert isinstance(err["type"], str) and err["type"], r.text
        assert err["param"] is None or isinstance(err["param"], str), r.text
    elif path == RESP:
        check_response(r)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-2000:]
        for line in r.text.split("\n"):  # SSE lines (see ``check_response``)
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert event.get("error", {}).get("type") != "internal_error", line
    else:
        assert r.json()["choices"], r.text


def check_response(r: httpx.Response) -> None:
    """A served ``/v1/responses`` answer: a finished ``response`` object, or events numbered
    from 0 whose last one finishes it (never ``response.failed``)."""
    if not r.headers["content-type"].startswith("text/event-stream"):
        resp = r.json()
        assert resp["object"] == "response" and resp["output"], r.text
        assert resp["status"] in ("completed", "incomplete"), r.text
        return
    # SSE ends lines at \n (and \r): not at the other breaks ``str.splitlines`` knows, such
    # as U+0085, which JSON strings may hold as they are
    events = [json.loads(line[6:]) for line in r.text.split("\n")
              if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events))), r.text[-2000:]
    assert events[0]["type"] == "response.created", r.text[:2000]
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), r.text[-2000:]


@pytest.mark.timeout(300)
@FUZZ
@given(body=completion_body)
def test_fuzz_completions(client: httpx.Client, body: dict[str, Any]) -> None:
    post(client, COMP, body)


@pytest.mark.timeout(300)
@FUZZ
@given(body=chat_body)
def test_fuzz_chat_completions(client: httpx.Client, body: dict[str, Any]) -> None:
    post(client, CHAT, body)


@pytest.mark.timeout(300)
@FUZZ
@given(body=responses_body)
def test_fuzz_responses(client: httpx.Client, body: dict[str, Any]) -> None:
    post(client, RESP, body)


@pytest.mark.timeout(120)
def test_known_cases_are_400_naming_the_field(client: httpx.Client) -> None:
    """The cases the fuzzing found (issue 26 item 8): each a 400 naming its field."""
    msgs = [{"role": "user", "content": "Hi"}]
    cases = [
        (COMP, {"prompt": "x", "max_tokens": 2, "stop": "\ud800"}, "stop"),
        (COMP, {"prompt": "x", "max_tokens": 2, "stop": ["ok", "a\udfff"]}, "stop"),
        (CHAT, {"messages": msgs, "max_tokens": 2, "stop": "\ud800"}, "stop"),
        (COMP, {"prompt": "\ud800", "max_tokens": 2}, "prompt"),
        (COMP, {"prompt": ["ok", "\udc00"], "max_tokens": 2}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
         "messages"),
        (CHAT, {"messages": msgs, "logit_bias": {"\ud800": 1}}, "logit_bias"),
        (CHAT, {"messages": msgs, "logit_bias": [0] * 5000}, "logit_bias"),
        (COMP, {"prompt": "x", "\ud800": 1}, None),  # pydantic refuses the key itself
        (RESP, {"input": "\ud800"}, "input"),
        (RESP, {"input": [{"role": "user", "content": [{"type": "input_text",
                                                        "text": "a\udfff"}]}]}, "input"),
        (RESP, {"input": "x", "instructions": "\ud800"}, "instructions"),
        (RESP, {"input": "x", "background": True}, "background"),
        (RESP, {"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        (RESP, {"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
    ]
    for path, body, param in cases:  # param None: the body as a whole
        for _ in range(2):  # the same keep-alive connection serves the next request
            r = client.post(path, content=json.dumps(body).encode(),
                            headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param, err
    # nested deeper than the JSON parser goes, and nearly that deep
    for depth in (100_000, 900):
        deep = b'{"prompt": "x", "user": ' + b"[" * depth + b"]" * depth + b"}"
        r = client.post(COMP, content=deep, headers={"content-type": "application/json"})
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert r.json()["error"]["type"] == "invalid_request_error", r.text
    r = client.post(COMP, json={"prompt": "x", "max_tokens": 2, "stop": "é😀"})
    assert r.status_code == 200, r.text


@pytest.mark.timeout(120)
def test_healthy_and_idle_after_fuzzing(srv: ServerProcess, client: httpx.Client) -> None:
    """Run after the fuzz tests (file order): the server still serves, nothing runs or waits,
    and no KV page is held once the radix cache is flushed."""
    assert client.get("/health").status_code == 200
    r = client.post(COMP, json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    wait_idle(srv.base_url, timeout_s=30)
    assert client.post("/flush_cache").status_code == 200

    def nothing_held() -> dict[str, float] | None:
        m = metrics_values(srv.base_url)
        held = (m["radixserve:num_requests_running"], m["radixserve:num_requests_waiting"],
                m["radixserve:kv_cache_pages_used"])
        return m if held == (0, 0, 0) else None

    wait_until(nothing_held, "no request running or waiting and no KV page used", 30)
