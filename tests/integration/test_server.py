"""The OpenAI-compatible server end to end: a real ``radixserve serve`` process with the default
model, driven by the official ``openai`` package (and httpx for raw HTTP)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI
from server_utils import metrics_values, wait_idle

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def aclient_factory(server):
    def make() -> AsyncOpenAI:
        return AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", timeout=300,
                           max_retries=0)
    return make


def stream_chat(client: OpenAI, **kw) -> tuple[dict[int, str], dict[int, str], list]:
    """Streamed chat: text per choice index, finish_reason per index, all chunks."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, chunks


def stream_completion(client: OpenAI, **kw) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(client.completions.create(model=MODEL, stream=True, **kw))
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, chunks


# -- basics ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_models_health_version(server, client: OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert "version" in httpx.get(server.base_url + "/version").json()


@pytest.mark.timeout(60)
def test_models_retrieve(server, client: OpenAI) -> None:
    listed = client.models.list().data[0]
    m = client.models.retrieve(MODEL)
    assert (m.id, m.object, m.owned_by) == (listed.id, "model", listed.owned_by)
    assert m.model_extra["max_model_len"] == listed.model_extra["max_model_len"] > 0
    r = httpx.get(server.base_url + "/v1/models/gpt-9")
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]


@pytest.mark.timeout(120)
def test_chat_stream_equals_non_stream(client: OpenAI) -> None:
    kw = dict(messages=CHAT, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    full = client.chat.completions.create(model=MODEL, **kw)
    c = full.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    u = full.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 24
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens is not None
    texts, finish, chunks = stream_chat(client, **kw)
    assert texts[0] == c.message.content
    assert finish[0] == c.finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)


@pytest.mark.timeout(120)
def test_completion_prompt_forms(client: OpenAI) -> None:
    prompt = "The capital of France is"
    kw = dict(max_tokens=6, temperature=0)
    one = client.completions.create(model=MODEL, prompt=prompt, **kw)
    text = one.choices[0].text
    assert text and one.choices[0].finish_reason == "length"
    assert one.usage.completion_tokens == 6
    ids = httpx.post(str(client.base_url).replace("/v1/", "") + "/tokenize",
                     json={"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, **kw)
    assert by_ids.choices[0].text == text
    many = client.completions.create(model=MODEL, prompt=[prompt, "1, 2, 3,"], **kw)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == text
    assert many.usage.prompt_tokens == len(ids) + len(
        httpx.post(str(client.base_url).replace("/v1/", "") + "/tokenize",
                   json={"prompt": "1, 2, 3,", "add_special_tokens": False}).json()["tokens"])
    lists = client.completions.create(model=MODEL, prompt=[ids, ids], **kw)
    assert [c.text for c in lists.choices] == [text, text]
    texts, finish, _ = stream_completion(client, prompt=[prompt, "1, 2, 3,"], **kw)
    assert texts == {0: text, 1: many.choices[1].text}
    assert finish == {0: "length", 1: "length"}


@pytest.mark.timeout(120)
def test_n2_stream_and_non_stream(client: OpenAI) -> None:
    kw = dict(messages=CHAT, max_tokens=12, temperature=1.0, seed=7, n=2)
    full = client.chat.completions.create(model=MODEL, **kw)
    assert [c.index for c in full.choices] == [0, 1]
    assert 2 <= full.usage.completion_tokens <= 24
    texts, finish, _ = stream_chat(client, **kw)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                     temperature=1.0, seed=3, n=2,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in comp.choices] == [0, 1]
    assert comp.usage.completion_tokens == 16


@pytest.mark.timeout(120)
def test_n3_stream_sends_one_choice_per_chunk(client: OpenAI) -> None:
    usage = {"include_usage": True}
    texts, finish, chunks = stream_chat(client, messages=CHAT, max_tokens=10, temperature=1.0,
                                        seed=5, n=3, stream_options=usage)
    assert sorted(texts) == sorted(finish) == [0, 1, 2]
    assert [len(ch.choices) for ch in chunks[:-1]] == [1] * (len(chunks) - 1)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    # the role chunk too: one per choice
    assert sorted(ch.choices[0].index for ch in chunks[:-1]
                  if ch.choices[0].delta.role) == [0, 1, 2]
    texts, finish, chunks = stream_completion(client, prompt="Once upon a time", max_tokens=6,
                                              temperature=1.0, seed=3, n=3, echo=True,
                                              stream_options=usage,
                                              extra_body={"ignore_eos": True})
    assert all(t.startswith("Once upon a time") for t in texts.values())
    assert finish == {0: "length", 1: "length", 2: "length"}
    assert [len(ch.choices) for ch in chunks[:-1]] == [1] * (len(chunks) - 1)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18


@pytest.mark.timeout(120)
def test_stop_strings_trimmed_streaming_and_not(client: OpenAI) -> None:
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                     temperature=0).choices[0].text
    assert len(base) > 6
    # a stop string that starts inside one token and ends in a later one
    stop = base[2:6]
    want = base[:base.find(stop)]
    for stops in (stop, [stop, "never-appears"]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      stop=stops)
        assert r.choices[0].text == want
        assert r.choices[0].finish_reason == "stop"
        texts, finish, chunks = stream_completion(client, prompt=prompt, max_tokens=16,
                                                  temperature=0, stop=stops)
        assert texts[0] == want and finish[0] == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20,
                                          temperature=0).choices[0].message.content
    word = chat.split()[2]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0,
                                       stop=word)
    assert r.choices[0].message.content == chat[:chat.find(word)]
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.timeout(120)
def test_chat_logprobs(client: OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        top = [t.logprob for t in item.top_logprobs]
        assert top == sorted(top, reverse=True)  # most likely first
        # greedy: the chosen token is among the top logprobs with the maximum value; in bf16
        # several tokens can share that value exactly, so no unique argmax is assumed
        best = [t for t in item.top_logprobs if t.token == item.token]
        assert best, (item.token, item.top_logprobs)
        assert best[0].logprob == pytest.approx(top[0], rel=1e-6, abs=0)
        assert item.logprob == pytest.approx(top[0], rel=1e-6, abs=0)
        assert item.bytes is not None
    assert "".join(bytes(i.bytes).decode("utf-8", "replace") for i in content) \
        .startswith(r.choices[0].message.content[:5])
    _, _, chunks = stream_chat(client, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                               top_logprobs=3)
    streamed = [i for ch in chunks for c in ch.choices if c.logprobs for i in c.logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]
    none = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert none.choices[0].logprobs is None


@pytest.mark.timeout(120)
def test_completion_logprobs_and_echo(client: OpenAI) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(t) >= 2 for t in lp.top_logprobs)
    e = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                  echo=True)
    assert e.choices[0].text == prompt + r.choices[0].text
    texts, _, _ = stream_completion(client, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert texts[0] == prompt + r.choices[0].text


@pytest.mark.timeout(120)
def test_usage_cached_tokens_and_stream_usage(client: OpenAI) -> None:
    long_user = "Please read this carefully. " * 20 + "What is two plus two?"
    msgs = [{"role": "user", "content": long_user}]
    client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                           temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # the radix cache hit
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    assert all(ch.usage is None for ch in chunks[:-1])


@pytest.mark.timeout(120)
def test_streaming_multibyte_never_replacement_mid_stream(client: OpenAI) -> None:
    for prompt in ("Here are some emojis: 😀😃😄", "中文：你好，世界。我们"):
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                         temperature=0).choices[0].text
        texts, _, chunks = stream_completion(client, prompt=prompt, max_tokens=16, temperature=0)
        assert texts[0] == full
        pieces = [c.text for ch in chunks for c in ch.choices if c.text]
        assert pieces and all("\ufffd" not in p for p in pieces[:-1])
        assert any(ord(ch) > 0x2000 for ch in full)  # the output really is multi-byte


@pytest.mark.timeout(180)
def test_length_cut_mid_character_drops_the_incomplete_tail(client: OpenAI) -> None:
    prompt = "Here are some emojis: 😀😃😄"
    texts, cut_mid_char = [], 0
    for max_tokens in range(1, 13):
        kw = dict(prompt=prompt, max_tokens=max_tokens, temperature=0)
        full = client.completions.create(model=MODEL, **kw).choices[0]
        streamed, finish, _ = stream_completion(client, **kw)
        assert not full.text.endswith("\ufffd") and streamed[0] == full.text
        if full.finish_reason == "length" and texts and full.text == texts[-1]:
            cut_mid_char += 1  # the last token only began a character: nothing to show
        texts.append(full.text)
    assert cut_mid_char > 0  # the greedy output really is cut inside a character somewhere


@pytest.mark.timeout(90)
def test_sampling_fields_accepted_unknown_fields_refused(server, client: OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=4, temperature=0.5, top_p=0.9,
        seed=1, presence_penalty=0.5, frequency_penalty=0.5, user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
                    "ignore_eos": True, "stop_token_ids": [2], "whatever": None})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"
    raw = httpx.post(server.base_url + "/v1/completions",
                     json={"prompt": "Hi", "max_tokens": 2, "best_of": 1,
                           "logit_bias": {"1": 2}, "temperature": None}, timeout=60)
    assert raw.status_code == 200, raw.text
    raw = httpx.post(server.base_url + "/v1/completions",
                     json={"prompt": "Hi", "max_tokens": 2, "foo": [1, 2]}, timeout=60)
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "foo"


@pytest.mark.timeout(60)
def test_tokenize_detokenize(server) -> None:
    base = server.base_url
    t = httpx.post(base + "/tokenize", json={"prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] > 0
    d = httpx.post(base + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "Hello world"
    chat = httpx.post(base + "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > t["count"]
    assert httpx.post(base + "/detokenize", json={"tokens": [10**9]}).status_code == 400


@pytest.mark.timeout(60)
def test_tokenize_vllm_shape_with_token_strs(server) -> None:
    base = server.base_url
    t = httpx.post(base + "/tokenize", json={"prompt": "Hello world"}).json()
    assert set(t) == {"count", "max_model_len", "tokens"}
    s = httpx.post(base + "/tokenize", json={"prompt": "Hello world",
                                             "return_token_strs": True}).json()
    assert set(s) == {"count", "max_model_len", "tokens", "token_strs"}
    assert s["tokens"] == t["tokens"] and len(s["token_strs"]) == s["count"]
    assert all(isinstance(x, str) for x in s["token_strs"])
    assert httpx.post(base + "/detokenize", json={"tokens": t["tokens"]}).json() == {
        "prompt": "Hello world"}


# -- concurrency -----------------------------------------------------------------------------------


def _first_divergence_is_near_tie(a: list, b: list) -> bool:
    """Greedy outputs as logprob content lists: identical, or at the first differing token each
    side's token is in the other's top-5 (fp32 kernels differ ~1e-6 between batch sizes)."""
    for x, y in zip(a, b, strict=False):
        if x.token != y.token:
            return (x.token in {t.token for t in y.top_logprobs}
                    and y.token in {t.token for t in x.top_logprobs})
    return len(a) == len(b)


@pytest.mark.timeout(240)
def test_64_concurrent_streams_equal_alone(aclient_factory) -> None:
    questions = ["What is 2+2?", "Name a fruit.", "Say hi.", "What color is the sky?",
                 "Name a planet.", "Give me a number.", "What is water?", "Name an animal."]
    kw = dict(model=MODEL, max_tokens=16, temperature=0, logprobs=True, top_logprobs=5)

    async def one(client: AsyncOpenAI, q: str) -> tuple[str, list, str]:
        text, lps, finish = "", [], None
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": q}], stream=True, **kw)
        async for ch in stream:
            for c in ch.choices:
                text += c.delta.content or ""
                if c.logprobs and c.logprobs.content:
                    lps += c.logprobs.content
                finish = c.finish_reason or finish
        return text, lps, finish

    async def run() -> tuple[list, list]:
        client = aclient_factory()
        alone = [await one(client, q) for q in questions]
        together = await asyncio.gather(*(one(client, questions[i % 8]) for i in range(64)))
        await client.close()
        return alone, together

    alone, together = asyncio.run(run())
    exact = 0
    for i, (text, lps, finish) in enumerate(together):
        ref_text, ref_lps, ref_finish = alone[i % 8]
        assert finish in ("stop", "length") and text
        if text == ref_text:
            exact += 1
            assert finish == ref_finish
        else:
            assert _first_divergence_is_near_tie(lps, ref_lps), (i, text, ref_text)
    print(f"{exact}/64 concurrent greedy streams identical to the request sent alone")
    assert exact >= 56, f"only {exact}/64 identical to the request sent alone"


# -- disconnects -----------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_disconnects_abort_and_release_pages(server) -> None:
    base = server.base_url
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as http:
        for _ in range(20):
            with http.stream("POST", base + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                got = 0
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        got += 1
                        if got == 3:
                            break
            # leaving the block closed the connection mid-stream
    m = wait_idle(base, timeout_s=10)
    assert m["radixserve:num_requests_running"] == 0
    # a non-streaming request whose client gives up: aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/chat/completions", timeout=1.5,
                   json={**body, "stream": False, "max_tokens": 2000})
    wait_idle(base, timeout_s=10)


@pytest.mark.timeout(60)
def test_metrics_exposes_the_promised_series(server, client: OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "request_prefill_time_seconds_bucket", "request_decode_time_seconds_bucket",
                 "request_inference_time_seconds_bucket", "request_prompt_tokens_bucket",
                 "request_generation_tokens_bucket", "request_success_total"):
        assert "radixserve:" + name in text, name
    m = metrics_values(server.base_url)
    assert m["radixserve:e2e_request_latency_seconds_count"] > 0
    assert m["radixserve:request_queue_time_seconds_count"] > 0


@pytest.mark.timeout(60)
def test_metrics_per_request_histograms_count_one_request(server, client: OpenAI) -> None:
    """One finished request adds one sample to each per-request histogram: its prompt and
    output lengths exactly, and phase times that add up to no more than its latency."""
    wait_idle(server.base_url)
    before = metrics_values(server.base_url)
    # several KV pages long, so that the radix cache keeps some of it
    r = client.completions.create(model=MODEL, prompt="The capital of France is Paris. " * 12,
                                  max_tokens=5, extra_body={"ignore_eos": True})
    after = metrics_values(server.base_url)

    def grew(name: str) -> float:
        return after["radixserve:" + name] - before.get("radixserve:" + name, 0.0)

    for h in ("request_prompt_tokens", "request_generation_tokens", "e2e_request_latency_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_inference_time_seconds", "request_queue_time_seconds"):
        assert grew(h + "_count") == 1, h
    assert grew("request_prompt_tokens_sum") == r.usage.prompt_tokens > 0
    assert grew("request_generation_tokens_sum") == r.usage.completion_tokens == 5
    e2e = grew("e2e_request_latency_seconds_sum")
    prefill, decode = grew("request_prefill_time_seconds_sum"), grew(
        "request_decode_time_seconds_sum")
    inference = grew("request_inference_time_seconds_sum")
    assert 0 < decode < e2e  # 4 decode steps after the first token
    assert 0 <= prefill < e2e
    assert abs(inference - (prefill + decode)) < 1e-6
    assert inference + grew("request_queue_time_seconds_sum") == pytest.approx(e2e, abs=1e-6)
    # idle again: the radix cache keeps the prompt's pages, which count as free (as vLLM's
    # cached free blocks do), so the KV usage is back at 0
    idle = wait_idle(server.base_url)
    assert idle["radixserve:kv_cache_pages_cached"] > 0
    assert idle["radixserve:kv_cache_usage_perc"] == 0
