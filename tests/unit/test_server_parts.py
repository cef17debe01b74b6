"""Server building blocks without a model: middlewares, the context-length check, logprob and
usage shapes, the byte-level token bytes table."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from radixserve.entrypoints.openai.errors import OpenAIError, add_exception_handlers
from radixserve.entrypoints.openai.middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.entrypoints.openai.serving_common import (
    Choice,
    child_params,
    completion_logprobs,
    sampling_params_for,
    usage_dict,
)
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
    with pytest.raises(OpenAIError) as e:
        sampling_params_for(req, 100, 100, 16, "prompt")
    assert e.value.param == "prompt" and "100" in e.value.message
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert sampling_params_for(chat, 30, 100, None, "messages").max_tokens == 70
    assert sampling_params_for(req.model_copy(update={"max_tokens": None}), 90, 100, 16,
                               "prompt").max_tokens == 10
    with pytest.raises(OpenAIError) as e:
        sampling_params_for(chat.model_copy(update={"temperature": -1.0}), 3, 100, None,
                            "messages")
    assert e.value.param == "temperature"


def test_child_params_and_usage() -> None:
    sp = SamplingParams(n=3, seed=10, temperature=1.0)
    assert [child_params(sp, i).seed for i in range(3)] == [10, 11, 12]
    assert child_params(sp, 2).n == 1
    choices = []
    for i, (prompt, cached, out) in enumerate([([1, 2, 3], 2, 4), ([1, 2, 3], 3, 5),
                                               ([7], 0, 1), ([7], 0, 2)]):
        c = Choice(i, f"r{i}", prompt, detok=None)  # type: ignore[arg-type]
        c.num_cached_tokens = cached
        choices.append((c, out))

    class FakeDetok:
        def __init__(self, n: int) -> None:
            self.token_ids = [0] * n

    for c, out in choices:
        c.detok = FakeDetok(out)  # type: ignore[assignment]
    u = usage_dict([c for c, _ in choices], n=2)
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
