"""``/v1/completions`` with ``echo`` + ``logprobs`` (OpenAI's shape, what evaluation harnesses
send) and vLLM's ``prompt_logprobs``, from a float32 server that prefills in 32-token chunks:
the values equal a direct log-softmax over transformers' float32 logits on the same tokens,
also for a prompt whose prefix sits in the radix cache."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from server_utils import ServerProcess

pytestmark = pytest.mark.slow

PROMPT = ("Question: What is the boiling point of water at sea level? Answer: The boiling "
          "point of water at sea level is 100 degrees Celsius, or 212 degrees Fahrenheit.")


@pytest.fixture(scope="module")
def f32_server(tmp_path_factory: pytest.TempPathFactory):
    srv = ServerProcess(["--dtype", "float32", "--num-pages", "64", "--max-num-seqs", "8",
                         "--max-num-batched-tokens", "32", "--seed", "0"],
                        tmp_path_factory.mktemp("f32"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _post(srv: ServerProcess, body: dict) -> dict:
    r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference(hf_reference, f32_server):
    """(prompt token ids as the server tokenizes them, transformers' float32 log-softmax)."""
    ids = httpx.post(f32_server.base_url + "/tokenize",
                     json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    model, _ = hf_reference
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert len(ids) > 32  # several prefill chunks
    return ids, lp


@pytest.mark.timeout(300)
def test_echo_logprobs_equal_transformers(f32_server, reference) -> None:
    ids, ref = reference
    _post(f32_server, {"prompt": PROMPT, "max_tokens": 1})  # its prefix is cached now
    for max_tokens in (0, 1):
        body = _post(f32_server, {"prompt": PROMPT, "echo": True, "logprobs": 2,
                                  "max_tokens": max_tokens, "temperature": 0})
        ch = body["choices"][0]
        lp = ch["logprobs"]
        n = len(ids)
        assert len(lp["tokens"]) == n + max_tokens and ch["text"].startswith(PROMPT)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(1, n):
            want = float(ref[p - 1, ids[p]])
            assert abs(lp["token_logprobs"][p] - want) < 1e-3, (p, lp["token_logprobs"][p])
            top = lp["top_logprobs"][p]
            assert len(top) in (2, 3)  # the top 2, plus the prompt's token when not among them
            assert abs(max(top.values()) - float(ref[p - 1].max())) < 1e-3
        if max_tokens == 0:  # the prompt alone, as lm-eval's loglikelihood requests expect
            assert ch["text"] == PROMPT and body["usage"]["completion_tokens"] == 0
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed


@pytest.mark.timeout(300)
def test_vllm_prompt_logprobs_ranks_and_stream_echo(f32_server, reference) -> None:
    ids, ref = reference
    body = _post(f32_server, {"prompt": PROMPT, "prompt_logprobs": 1, "max_tokens": 1})
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for p in (1, len(ids) // 2, len(ids) - 1):
        entry = plp[p][str(ids[p])]
        row = ref[p - 1]
        assert abs(entry["logprob"] - float(row[ids[p]])) < 1e-3
        assert entry["rank"] == int((row > row[ids[p]]).sum()) + 1
    # streamed echo + logprobs: the same prompt logprobs, in the first chunk
    r = httpx.post(f32_server.base_url + "/v1/completions", timeout=300, json={
        "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 2, "stream": True,
        "temperature": 0})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(PROMPT)
    got = first["logprobs"]["token_logprobs"][:len(ids)]
    assert got[0] is None
    assert all(abs(got[p] - float(ref[p - 1, ids[p]])) < 1e-3 for p in range(1, len(ids)))
    r = httpx.post(f32_server.base_url + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
