"""Server building blocks without a model: middlewares, the frontend's part of the
context-length rule, engine requests for n > 1, logprob and usage shapes, the byte-level token
bytes table."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from radixserve.entrypoints.openai.errors import OpenAIError, add_exception_handlers
from radixserve.entrypoints.openai.logprobs import completion_logprobs
from radixserve.entrypoints.openai.middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.entrypoints.openai.serving_request import engine_requests, sampling_params_for
from radixserve.entrypoints.openai.usage import usage_dict
from radixserve.frontend.output_processor import RequestState
from radixserve.frontend.tokenizer import _BYTE_DECODER, bytes_to_unicode
from radixserve.sampling_params import SamplingParams


def _app(**limits) -> TestClient:
    app = FastAPI()
    add_exception_handlers(app)

    @app.post("/v1/echo")
    async def echo(raw: Request) -> dict:
        return {"n": len(await raw.body())}

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=limits.get("max_bytes", 100))
    if "api_key" in limits:
        app.add_middleware(APIKeyMiddleware, api_key=limits["api_key"])
    return TestClient(app)


def test_api_key_guards_v1_only() -> None:
    c = _app(api_key="k")
    r = c.post("/v1/echo", content=b"x")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert c.post("/v1/echo", content=b"x", headers={"Authorization": "Bearer nope"}
                  ).status_code == 401
    assert c.post("/v1/echo", content=b"x", headers={"Authorization": "Bearer k"}
                  ).json() == {"n": 1}
    assert c.get("/health").status_code == 200


def test_unknown_route_and_wrong_method_are_openai_errors() -> None:
    c = _app()
    r = c.get("/v1/nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "not_found_error" and "/v1/nope" in err["message"]
    r = c.get("/v1/echo")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "GET" in err["message"]
    assert err["type"] == "invalid_request_error"


def test_body_limit_by_header_and_by_stream() -> None:
    c = _app(max_bytes=100)
    assert c.post("/v1/echo", content=b"x" * 100).json() == {"n": 100}
    r = c.post("/v1/echo", content=b"x" * 101)
    assert r.status_code == 413 and set(r.json()["error"]) == {"message", "type", "param",
                                                               "code"}

    def chunked():
        for _ in range(5):
            yield b"y" * 30

    assert c.post("/v1/echo", content=chunked()).status_code == 413


def test_context_length_check_names_the_numbers() -> None:
    req = CompletionRequest(prompt="x", max_tokens=50)
    with pytest.raises(OpenAIError) as e:
        sampling_params_for(req, 60, 100, 16, "prompt")
    assert e.value.status_code == 400 and e.value.param == "max_tokens"
    assert all(str(n) in e.value.message for n in (100, 110, 60, 50))
    # a prompt that leaves no room is the engine core's to reject (one authority; relayed as
    # a 400 naming the prompt: tests/integration/test_server_errors.py): not checked here, and
    # the default max_tokens is left alone for it
    assert sampling_params_for(req.model_copy(update={"max_tokens": None}), 100, 100, 16,
                               "prompt").max_tokens == 16
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    # no max_tokens in a chat: all the room left, which the engine core fills in (see
    # test_output_processor.py::test_engine_fills_in_max_tokens_none)
    assert sampling_params_for(chat, 30, 100, None, "messages").max_tokens is None
    assert sampling_params_for(req.model_copy(update={"max_tokens": None}), 90, 100, 16,
                               "prompt").max_tokens == 10
    with pytest.raises(OpenAIError) as e:
        sampling_params_for(chat.model_copy(update={"temperature": -1.0}), 3, 100, None,
                            "messages")
    assert e.value.param == "temperature"


def test_engine_requests_split_n_and_usage() -> None:
    sp = SamplingParams(n=3, seed=10, temperature=1.0)
    reqs = engine_requests("abc", [[1, 2], [7]], sp, arrival_time=5.0)
    assert [r.sampling_params.seed for r in reqs] == [10, 11, 12] * 2
    assert all(r.sampling_params.n == 1 and r.arrival_time == 5.0 for r in reqs)
    assert [r.prompt_token_ids.tolist() for r in reqs] == [[1, 2]] * 3 + [[7]] * 3
    assert all(r.prompt_token_ids.dtype == np.int32 for r in reqs)
    assert all(r.eos_token_ids is None for r in reqs)  # the core knows the model's EOS
    ids = [r.request_id for r in reqs]
    assert ids == [f"abc-{k}" for k in range(6)]  # the API request's id, the choice index
    (one,) = engine_requests("abc", [[1, 2]], SamplingParams(), arrival_time=5.0)
    assert one.request_id == "abc"  # one engine request: the client's id as it is

    class FakeDetok:
        def __init__(self, n: int) -> None:
            self.token_ids = [0] * n

    states = []
    for i, (prompt, cached, out) in enumerate([([1, 2, 3], 2, 4), ([1, 2, 3], 3, 5),
                                               ([7], 0, 1), ([7], 0, 2)]):
        st = RequestState(f"r{i}", i, prompt, SamplingParams(), 0.0,
                          FakeDetok(out))  # type: ignore[arg-type]
        st.num_cached_tokens = cached
        states.append(st)
    u = usage_dict(states, n=2)
    assert u == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16,
                 "prompt_tokens_details": {"cached_tokens": 2}}


def test_completion_logprobs_shape() -> None:
    class Tok:
        def token_str(self, t: int) -> str:
            return {1: "a", 2: "bc", 3: "d"}[t]

    rows = [[[2, -0.1], [2, -0.1], [3, -2.5]], [[3, float("-inf")], [1, -0.5]]]
    lp, end = completion_logprobs(Tok(), rows, 5, prompt_ids=[1])  # type: ignore[arg-type]
    assert lp["tokens"] == ["a", "bc", "d"]
    assert lp["token_logprobs"] == [None, -0.1, -9999.0]
    assert lp["text_offset"] == [5, 6, 8] and end == 9
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {"bc": -0.1, "d": -2.5}
    assert lp["top_logprobs"][2] == {"a": -0.5, "d": -9999.0}


def test_byte_level_table_round_trips() -> None:
    table = bytes_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert all(_BYTE_DECODER[ch] == b for b, ch in table.items())
    # "Ġ" is the byte-level spelling of a space
    assert _BYTE_DECODER["Ġ"] == 32
