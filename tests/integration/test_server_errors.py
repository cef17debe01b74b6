"""Bad input against a real server: each gets an OpenAI-style error body with the right status,
the server keeps serving, and no KV page leaks."""

from __future__ import annotations

import httpx
import pytest
from server_utils import wait_idle

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "Hi"}]

CASES = [
    # (id, path, body (dict, or raw bytes), status, param the error names or None)
    ("malformed-json", CHAT, b'{"messages": [', 400, None),
    ("not-an-object", CHAT, b"[1, 2]", 400, None),
    ("messages-wrong-type", CHAT, {"messages": "hello"}, 400, "messages"),
    ("temperature-wrong-type", CHAT, {"messages": MSGS, "temperature": "hot"}, 400,
     "temperature"),
    ("max-tokens-wrong-type", COMP, {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("stream-wrong-type", CHAT, {"messages": MSGS, "stream": {"a": 1}}, 400, "stream"),
    ("missing-messages", CHAT, {"model": "x"}, 400, "messages"),
    ("missing-prompt", COMP, {"max_tokens": 3}, 400, "prompt"),
    ("unknown-model-chat", CHAT, {"model": "gpt-9", "messages": MSGS}, 404, "model"),
    ("unknown-model-completion", COMP, {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("n-zero", CHAT, {"messages": MSGS, "n": 0}, 400, "n"),
    ("temperature-negative", CHAT, {"messages": MSGS, "temperature": -0.5}, 400,
     "temperature"),
    ("top-p-zero", CHAT, {"messages": MSGS, "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", COMP, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top-logprobs-too-large", CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21},
     400, "logprobs"),
    ("logprobs-too-large", COMP, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("empty-messages", CHAT, {"messages": []}, 400, "messages"),
    ("invalid-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("empty-prompt-string", COMP, {"prompt": ""}, 400, "prompt"),
    ("empty-prompt-list", COMP, {"prompt": []}, 400, "prompt"),
    ("token-id-out-of-range", COMP, {"prompt": [1, 2, 10**7]}, 400, "prompt"),
    ("negative-token-id", COMP, {"prompt": [[1, -5]]}, 400, "prompt"),
    ("stream-bad-input-is-plain-400", CHAT, {"messages": MSGS, "n": 0, "stream": True}, 400,
     "n"),
    ("max-tokens-zero", COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("stream-options-without-stream-chat", CHAT,
     {"messages": MSGS, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("stream-options-with-stream-false-completion", COMP,
     {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("presence-penalty-range", CHAT, {"messages": MSGS, "presence_penalty": 5}, 400,
     "presence_penalty"),
]


def _check_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err
    return err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input(server, path: str, body, status: int, param: str | None) -> None:
    url = server.base_url + path
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"},
                       timeout=60)
    else:
        r = httpx.post(url, json=body, timeout=60)
    _check_error(r, status, param)


@pytest.mark.timeout(120)
def test_context_length_errors_name_the_numbers(server) -> None:
    base = server.base_url
    max_len = httpx.post(base + "/tokenize", json={"prompt": "x"}).json()["max_model_len"]
    prompt = "hello " * 50
    n_prompt = httpx.post(base + "/tokenize", json={"prompt": prompt,
                                                    "add_special_tokens": False}).json()["count"]
    r = httpx.post(base + COMP, json={"prompt": prompt, "max_tokens": max_len}, timeout=60)
    err = _check_error(r, 400, "max_tokens")
    for number in (max_len, max_len + n_prompt, n_prompt):
        assert str(number) in err["message"], err["message"]
    r = httpx.post(base + CHAT, json={"messages": MSGS, "max_completion_tokens": max_len},
                   timeout=60)
    err = _check_error(r, 400, "max_tokens")
    assert str(max_len) in err["message"]
    # a prompt longer than the context on its own
    r = httpx.post(base + COMP, json={"prompt": [1] * (max_len + 1)}, timeout=60)
    err = _check_error(r, 400, "prompt")
    assert str(max_len) in err["message"] and str(max_len + 1) in err["message"]


@pytest.mark.timeout(120)
def test_one_megabyte_prompt_is_refused_not_a_crash(server) -> None:
    big = "lorem ipsum dolor sit amet " * 40000  # ~1 MB
    r = httpx.post(server.base_url + CHAT, json={"messages": [{"role": "user", "content": big}]},
                   timeout=120)
    _check_error(r, 400, "messages")
    r = httpx.post(server.base_url + COMP, json={"prompt": big, "max_tokens": 1}, timeout=120)
    _check_error(r, 400, None)


@pytest.mark.timeout(60)
def test_body_over_default_limit_gets_413(server) -> None:
    big = b'{"prompt": "' + b"a" * (8 * 1024 * 1024 + 10) + b'"}'
    r = httpx.post(server.base_url + COMP, content=big,
                   headers={"content-type": "application/json"}, timeout=60)
    _check_error(r, 413, None)


@pytest.mark.timeout(120)
def test_still_serving_and_no_pages_leaked_after_bad_input(server) -> None:
    wait_idle(server.base_url, timeout_s=10)
    assert httpx.get(server.base_url + "/health").status_code == 200
    r = httpx.post(server.base_url + COMP, json={"prompt": "Hello", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    wait_idle(server.base_url, timeout_s=10)


#: Values the engine cannot represent (MessagePack ints are 64-bit; token ids and counts are
#: int32): each must be a 400 naming the field, never an engine-link failure.
UNREPRESENTABLE = [
    (CHAT, {"messages": MSGS, "seed": -2**63 - 1}, "seed"),
    (CHAT, {"messages": MSGS, "seed": -2**63 - 1, "stream": True}, "seed"),
    (COMP, {"prompt": "x", "seed": 2**64}, "seed"),
    (CHAT, {"messages": MSGS, "n": 129}, "n"),
    (COMP, {"prompt": "x", "top_k": 2**63}, "top_k"),
    (COMP, {"prompt": "x", "stop_token_ids": [2**64]}, "stop_token_ids"),
    (COMP, {"prompt": "x", "min_tokens": 2**40, "max_tokens": 2}, "min_tokens"),
]


@pytest.mark.timeout(120)
def test_unrepresentable_ints_are_400_and_server_stays_up(server) -> None:
    base = server.base_url
    for path, body, param in UNREPRESENTABLE:
        r = httpx.post(base + path, json={**body, "max_tokens": body.get("max_tokens", 2)},
                       timeout=60)
        _check_error(r, 400, param)
        # the very next request is served: the engine link survived
        ok = httpx.post(base + CHAT, json={"messages": MSGS, "max_tokens": 2, "seed": 2**64 - 1,
                                           "n": 2, "ignore_eos": True}, timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(base + "/health").status_code == 200
    wait_idle(base, timeout_s=10)


@pytest.mark.timeout(120)
def test_prompt_without_room_is_the_engines_rejection_relayed(server) -> None:
    """The engine core alone decides that a prompt leaves no room; its rejection comes back as
    a plain 400 naming the API's prompt field, streamed or not."""
    base = server.base_url
    max_len = httpx.post(base + "/tokenize", json={"prompt": "x"}).json()["max_model_len"]
    for stream in (False, True):
        r = httpx.post(base + COMP, json={"prompt": [1] * max_len, "max_tokens": 1,
                                          "stream": stream}, timeout=60)
        err = _check_error(r, 400, "prompt")
        assert err["code"] == "context_length_exceeded" and str(max_len) in err["message"]
    words = "hello " * (max_len + 10)
    r = httpx.post(base + CHAT, json={"messages": [{"role": "user", "content": words}],
                                      "stream": True}, timeout=60)
    err = _check_error(r, 400, "messages")
    assert err["code"] == "context_length_exceeded"
    wait_idle(base, timeout_s=10)


@pytest.mark.timeout(60)
def test_unknown_route_and_wrong_method_are_openai_errors(server) -> None:
    base = server.base_url
    _check_error(httpx.get(base + "/v1/does-not-exist"), 404, None)
    _check_error(httpx.post(base + "/nope", json={}), 404, None)
    r = httpx.get(base + CHAT)
    _check_error(r, 405, None)
    assert "POST" in r.headers["allow"]
    _check_error(httpx.delete(base + "/v1/models"), 405, None)
