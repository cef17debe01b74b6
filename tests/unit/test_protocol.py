"""OpenAI protocol models and error bodies."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from radixserve.entrypoints.openai.errors import (
    OpenAIError,
    add_exception_handlers,
    error_from_validation,
    error_from_value_error,
    error_response,
)
from radixserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)
from radixserve.sampling_params import SamplingParams

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS, **kw})


def test_defaults_match_openai():
    r = chat()
    assert (r.temperature, r.top_p, r.n, r.max_tokens, r.stream) == (1.0, 1.0, 1, None, False)
    sp = r.to_sampling_params(default_max_tokens=123)
    assert sp.max_tokens == 123 and sp.temperature == 1.0 and sp.top_k == -1
    assert sp.logprobs is None and sp.stop is None and sp.skip_special_tokens


def test_null_means_default_and_no_op_fields_accepted():
    r = chat(response_format={"type": "text"}, temperature=None, top_p=None, n=None,
             stream=True, stream_options={"include_usage": True, "whatever": 1},
             user="u", metadata={"a": "b"}, store=False, service_tier="auto",
             reasoning_effort=None, functions=None)
    assert r.temperature == 1.0 and r.top_p == 1.0 and r.n == 1
    r.check()  # bookkeeping fields and null unknown fields change nothing: accepted
    c = CompletionRequest.model_validate({"prompt": "x", "best_of": 1, "suffix": None})
    c.check()
    assert c.to_sampling_params(5).max_tokens == 5


@pytest.mark.parametrize("body,param", [
    ({"foo": 1}, "foo"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ({"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ({"priority": 3}, "priority"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern"),
])
def test_fields_that_would_change_output_are_refused(body, param):
    with pytest.raises(OpenAIError) as e:
        chat(**body).check()
    assert e.value.status_code == 400 and e.value.param == param
    assert e.value.code == "unsupported_parameter"


def test_router_fields_with_their_defaults_accepted_and_no_stop_trim_honoured():
    # vllm-router and SGLang's router write these into every chat request they forward
    router = {"no_stop_trim": False, "separate_reasoning": True, "stream_reasoning": True,
              "return_hidden_states": False, "include_reasoning": True}
    r = chat(**router)
    r.check()
    assert not r.to_sampling_params(default_max_tokens=4).include_stop_str_in_output
    r = chat(**{**router, "no_stop_trim": True, "separate_reasoning": False})
    r.check()
    assert r.to_sampling_params(default_max_tokens=4).include_stop_str_in_output
    c = CompletionRequest.model_validate({"prompt": "x", "no_stop_trim": True})
    c.check()
    assert c.to_sampling_params(5).include_stop_str_in_output


@pytest.mark.parametrize("body,param", [({"suffix": "tail"}, "suffix"),
                                        ({"best_of": 3}, "best_of"), ({"bar": [1]}, "bar")])
def test_completion_fields_that_would_change_output_are_refused(body, param):
    with pytest.raises(OpenAIError) as e:
        CompletionRequest.model_validate({"prompt": "x", **body}).check()
    assert e.value.param == param


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
@pytest.mark.parametrize("stream", [False, None, "absent"])
def test_stream_options_need_stream(model, stream):
    body = {"messages": MSGS, "prompt": "x", "stream_options": {"include_usage": True}}
    if stream != "absent":
        body["stream"] = stream
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    err = error_from_validation(e.value)
    assert err.status_code == 400 and err.param == "stream_options"
    assert "stream" in err.message
    # null stream_options is "not set", with or without stream
    assert model.model_validate({**body, "stream_options": None}).stream_options is None
    ok = model.model_validate({**body, "stream": True})
    assert ok.include_usage


def test_message_content_forms():
    r = chat(messages=[{"role": "developer", "content": "a"},
                       {"role": "user", "content": [{"type": "text", "text": "b"},
                                                    {"type": "text", "text": "c"}]},
                       {"role": "assistant", "content": None},
                       {"role": "tool", "content": "d", "tool_call_id": "1"}])
    assert [m.text() for m in r.messages] == ["a", "bc", "", "d"]
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(ValidationError):
        chat(messages=[])


@pytest.mark.parametrize("stop,expected", [("###", ["###"]), (["a", "b"], ["a", "b"]),
                                           (None, None)])
def test_stop_str_or_list(stop, expected):
    assert chat(stop=stop).to_sampling_params(10).stop == expected
    assert CompletionRequest(prompt="x", stop=stop).to_sampling_params(10).stop == expected


def test_chat_mapping():
    r = chat(max_tokens=7, max_completion_tokens=9, temperature=0.5, top_p=0.9, top_k=40,
             min_p=0.05, seed=3, stop_token_ids=[5], ignore_eos=True, min_tokens=2,
             presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
             logprobs=True, top_logprobs=4, skip_special_tokens=False,
             include_stop_str_in_output=True, n=2)
    sp = r.to_sampling_params(100)
    assert sp.max_tokens == 9  # max_completion_tokens wins
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed) == (0.5, 0.9, 40, 0.05, 3)
    assert (sp.stop_token_ids, sp.ignore_eos, sp.min_tokens, sp.n) == ([5], True, 2, 2)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -0.5, 1.1)
    assert sp.logprobs == 4 and not sp.skip_special_tokens and sp.include_stop_str_in_output
    assert chat(max_tokens=7).to_sampling_params(100).max_tokens == 7
    assert chat(logprobs=True).to_sampling_params(100).logprobs == 0
    assert chat(logprobs=False).to_sampling_params(100).logprobs is None


def test_completion_mapping_and_prompt_forms():
    c = CompletionRequest(prompt="hi", logprobs=3, echo=True, max_tokens=4)
    sp = c.to_sampling_params(100)
    assert sp.logprobs == 3 and sp.max_tokens == 4 and c.echo
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    for bad in ([], [[]], None, 3.5, [{"x": 1}]):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": bad})


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("n", 0), ("max_tokens", 0),
    ("presence_penalty", 3.0), ("repetition_penalty", 0.0), ("min_p", 2.0), ("top_k", -5),
    ("stop", [""]), ("stop_token_ids", [-1]),
    # ints the engine cannot represent (64-bit MessagePack ints, int32 token ids and counts;
    # a seed out of range is pydantic's error, as vLLM's: test_vllm_fields.py)
    ("n", 129), ("top_k", 2**31), ("top_k", 2**63),
    ("max_tokens", 2**31), ("min_tokens", 2**31), ("stop_token_ids", [2**31]),
    ("stop_token_ids", [2**64]), ("temperature", float("inf")),
    ("repetition_penalty", float("inf")),
])
def test_bad_values_raise_value_error_naming_field(field, value):
    completion = CompletionRequest.model_validate({"prompt": "x", field: value})
    for req in (chat(**{field: value}), completion):
        with pytest.raises(ValueError) as info:
            req.to_sampling_params(16)
        err = error_from_value_error(info.value)
        assert err.status_code == 400 and err.param == field


def test_extreme_representable_values_encode():
    import msgspec

    sp = SamplingParams(seed=-2**63, n=128, top_k=2**31 - 1, max_tokens=2**31 - 1,
                        stop_token_ids=[2**31 - 1])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams) == sp
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_children_split_n_and_keep_seeds_in_range():
    sp = SamplingParams(n=3, seed=10, temperature=1.0, max_tokens=5)
    kids = sp.children()
    assert [k.seed for k in kids] == [10, 11, 12]
    assert all(k.n == 1 and k.max_tokens == 5 and k.temperature == 1.0 for k in kids)
    assert SamplingParams(n=2).children() == [SamplingParams()] * 2  # unseeded stay unseeded
    one = SamplingParams(seed=4)
    assert one.children() == [one]
    # seed + i past 2**64 - 1 wraps (the same torch generator state), so it still encodes
    top = SamplingParams(n=3, seed=2**64 - 2).children()
    assert [k.seed for k in top] == [2**64 - 2, 2**64 - 1, 0]


def test_logprob_limits():
    with pytest.raises(ValueError):
        chat(logprobs=True, top_logprobs=21).to_sampling_params(16)
    with pytest.raises(ValueError, match="top_logprobs"):
        chat(top_logprobs=2).to_sampling_params(16)
    with pytest.raises(ValueError):
        CompletionRequest(prompt="x", logprobs=21).to_sampling_params(16)


def test_bad_types_become_400_with_field_path():
    with pytest.raises(ValidationError) as info:
        chat(messages=[{"role": "user", "content": "x"}, {"role": "bogus"}])
    err = error_from_validation(info.value)
    assert err.status_code == 400 and err.type == "invalid_request_error"
    assert err.param == "messages.1.role"
    with pytest.raises(ValidationError) as info:
        chat(temperature="hot")
    assert error_from_validation(info.value).param == "temperature"


def test_tokenize_request_needs_one_input():
    assert TokenizeRequest(prompt="x").prompt == "x"
    assert TokenizeRequest(messages=MSGS).messages
    for body in ({}, {"prompt": "x", "messages": MSGS}):
        with pytest.raises(ValidationError):
            TokenizeRequest.model_validate(body)


def test_error_bodies_through_fastapi():
    app = FastAPI()
    add_exception_handlers(app)

    @app.post("/v1/chat/completions")
    async def create(req: ChatCompletionRequest):
        try:
            req.to_sampling_params(16)
        except ValueError as exc:
            raise error_from_value_error(exc) from exc
        return {"ok": True}

    @app.get("/missing")
    async def missing():
        raise OpenAIError("no such model", 404, code="model_not_found")

    @app.get("/boom")
    async def boom():
        raise RuntimeError("kaput")

    client = TestClient(app, raise_server_exceptions=False)
    ok = client.post("/v1/chat/completions", json={"messages": MSGS})
    assert ok.status_code == 200
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "top_p": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "x"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages.0.role"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/chat/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "message" in r.json()["error"]
    r = client.get("/missing")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "no such model", "type": "not_found_error",
                                  "param": None, "code": "model_not_found"}}
    r = client.get("/boom")
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
    assert error_response("x", 401).status_code == 401


@pytest.mark.parametrize("model,body,param,where", [
    (CompletionRequest, {"prompt": "\ud800"}, "prompt", "prompt "),
    (CompletionRequest, {"prompt": ["ok", "a\udfffb"]}, "prompt", "prompt.1 "),
    (CompletionRequest, {"prompt": "x", "stop": "\ud800"}, "stop", "stop "),
    (ChatCompletionRequest, {"messages": MSGS, "stop": ["a", "\udc00"]}, "stop", "stop.1 "),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\ud800"}]}]}, "messages", "messages.0.content.0.text "),
    (ChatCompletionRequest, {"messages": MSGS, "logit_bias": {"\ud800": 1}}, "logit_bias",
     "logit_bias.\\ud800 "),
    (ChatCompletionRequest, {"messages": MSGS, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"x": ["\ud800"]}}}]}, "tools", "tools.0.function."),
    (TokenizeRequest, {"prompt": "\ud800"}, "prompt", "prompt "),
])
def test_lone_surrogate_is_400_naming_the_field(model, body, param, where):
    """A lone surrogate (JSON's ``\\ud800``) is no text the tokenizer or the engine link
    takes: a validation error naming the field, with the exact place in the message; the
    error body encodes as UTF-8."""
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    err = error_from_validation(e.value)
    assert err.status_code == 400 and err.param == param
    assert where in err.message and "lone surrogate" in err.message, err.message
    err.to_response()  # encodes


def test_astral_and_odd_text_is_accepted():
    r = CompletionRequest.model_validate({"prompt": "\U0001f600 \x00 \u202e", "stop": "\ufeff"})
    assert r.prompt == "\U0001f600 \x00 \u202e" and r.stop == "\ufeff"


def test_error_body_with_a_lone_surrogate_still_encodes():
    """An error quoting the client's input (an unknown field's name, a dict key in
    ``param``) is written with the surrogate escaped, not a 500 from the encoder."""
    err = OpenAIError("Unsupported parameter: \ud800", param="\ud800")
    assert err.param == "\\ud800" and err.message.endswith("\\ud800")
    assert b"\\ud800" in err.to_response().body
