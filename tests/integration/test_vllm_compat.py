"""vLLM's request/response details and serve flags against one real server, through httpx
and the official ``openai`` client: HTTPS with a self-signed certificate made here, CORS
(``--allowed-origins``) behind ``--api-key``, several ``--served-model-name``s,
``--chat-template`` with a Llama 3-style template and ``--tool-call-parser llama3_json``
reading hand-written calls (the output forced by ``structured_outputs``), prompt logprobs
where vLLM puts them (``-1``: the whole vocabulary), token id fields, continuous usage on a
prompt prefilled in 32-token chunks, a chat stream cut inside an emoji, and the
``logit_bias`` / ``seed`` errors; and a server per ``--tool-call-parser`` mistral and
pythonic, each with its family's template style, reading hand-written calls whole and
streamed."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from server_utils import ServerProcess

pytestmark = pytest.mark.slow

KEY = "sk-compat"
ORIGIN = "https://app.example"
NAMES = ("smol", "smol-alias")
#: A Llama 3.1-style chat template that renders tools itself.
LLAMA3 = ("{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
          'Answer with a JSON object {"name": function name, "parameters": dict}.'
          "{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|eot_id|>{% endif %}"
          "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
          "{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
          "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
CALLS = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_weather", "parameters": {"city": "Rome"}}')


class HttpsServer(ServerProcess):
    """A ``ServerProcess`` that serves HTTPS with ``cert``; ready when /health answers."""

    def __init__(self, args: list[str], workdir: Path, cert: Path) -> None:
        super().__init__(args, workdir)
        self.cert = cert

    @property
    def base_url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, verify=str(self.cert), timeout=300,
                            headers={"Authorization": f"Bearer {KEY}"})

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", verify=str(self.cert),
                             timeout=2).status_code == 200:
                    self.engine_pid = self.child_pids()[0]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.log_tail()}")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("compat")
    key, cert = work / "key.pem", work / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    template = work / "llama3.jinja"
    template.write_text(LLAMA3)
    s = HttpsServer(["--num-pages", "128", "--max-num-seqs", "8", "--max-num-batched-tokens",
                     "32", "--seed", "0", "--api-key", KEY,
                     "--served-model-name", *NAMES, "--allowed-origins", json.dumps([ORIGIN]),
                     "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                     "--chat-template", str(template), "--enable-auto-tool-choice",
                     "--tool-call-parser", "llama3_json"], work, cert)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def http(srv: HttpsServer):
    with srv.client() as c:
        yield c


@pytest.fixture(scope="module")
def client(srv: HttpsServer) -> OpenAI:
    return OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=300,
                  http_client=httpx.Client(verify=str(srv.cert)))


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# -- the flags ---------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_https_names_and_cors(srv: HttpsServer, http: httpx.Client) -> None:
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the HTTPS port
        httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=5)
    with pytest.raises(httpx.ConnectError):  # the certificate is not trusted by default
        httpx.get(srv.base_url + "/health", timeout=5)
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == list(NAMES)
    r = http.post("/v1/completions", json={"model": NAMES[1], "prompt": "Hi",
                                           "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == NAMES[0]
    assert http.post("/v1/completions", json={"model": "other", "prompt": "Hi"}
                     ).status_code == 404
    # a browser's preflight carries no key; the answer names the origin
    pre = httpx.options(srv.base_url + "/v1/chat/completions", verify=str(srv.cert), headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    bad = httpx.options(srv.base_url + "/v1/chat/completions", verify=str(srv.cert), headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in bad.headers
    # a 401 still carries the header, so the page can read why
    r = httpx.get(srv.base_url + "/v1/models", verify=str(srv.cert), headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


@pytest.mark.timeout(240)
def test_llama3_json_tool_calls_whole_and_streamed(client: OpenAI, http: httpx.Client) -> None:
    # the server's --chat-template renders the tools
    toks = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                        "return_token_strs": True}).json()
    assert len(toks["token_strs"]) == toks["count"]
    kw = dict(model=NAMES[0], messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=[WEATHER], temperature=0, max_tokens=80,
              extra_body={"structured_outputs": {"choice": [CALLS]}})
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch.message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in
            ch.message.tool_calls] == [("get_weather", {"city": "Paris"}),
                                       ("get_weather", {"city": "Rome"})]
    calls: dict[int, list[str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, ["", ""])
            c[0] += tc.function.name or ""
            c[1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    plain = client.chat.completions.create(**{**kw, "extra_body": {
        "structured_outputs": {"choice": ["It is sunny in Paris."]}}})
    assert plain.choices[0].message.content == "It is sunny in Paris."
    assert not plain.choices[0].message.tool_calls


# -- vLLM's response fields ------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_prompt_logprobs_where_vllm_puts_them(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 1,
                                           "prompt_logprobs": -1}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) >= 3
    vocab = len(plp[1])
    assert vocab > 40000 and all(len(e) == vocab for e in plp[1:])
    assert sorted(int(t) for t in plp[1]) == list(range(vocab))  # every token of it
    assert sorted(e["rank"] for e in plp[1].values())[:3] == [1, 2, 3]
    # a prompt whose whole-vocabulary rows would outgrow one response: a 400 saying so
    big = http.post("/v1/completions", json={"prompt": "word " * 80, "max_tokens": 1,
                                             "prompt_logprobs": -1})
    assert big.status_code == 400 and big.json()["error"]["param"] == "prompt_logprobs"
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "prompt_logprobs": 2}).json()
    assert "prompt_logprobs" not in chat["choices"][0]
    assert chat["prompt_logprobs"][0] is None
    assert all(1 <= len(e) <= 3 for e in chat["prompt_logprobs"][1:])


@pytest.mark.timeout(240)
def test_token_id_fields_on_completion_choices(http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": "Hello there",
                                       "add_special_tokens": False}).json()["tokens"]
    body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "n": 2,
            "return_token_ids": True, "logprobs": 2, "return_tokens_as_token_ids": True}
    r = http.post("/v1/completions", json=body).json()
    for ch in r["choices"]:
        assert ch["prompt_token_ids"] == ids and len(ch["token_ids"]) == 3
        lp = ch["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in ch["token_ids"]]
        for top in lp["top_logprobs"]:
            assert all(k.startswith("token_id:") and k[9:].isdigit() for k in top)
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = _sse(s)
    firsts = {}
    for c in chunks:
        for ch in c["choices"]:
            firsts.setdefault(ch["index"], ch)
    assert all(ch["prompt_token_ids"] == ids for ch in firsts.values()) and len(firsts) == 2


@pytest.mark.timeout(240)
def test_continuous_usage_on_every_chunk_of_a_chunked_prompt(http: httpx.Client) -> None:
    long = "Tell me about the sea. " * 30  # ~180 tokens: six 32-token prefill chunks
    for path, body in (("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": long}]}),
                       ("/v1/completions", {"prompt": long})):
        with http.stream("POST", path, json={
                **body, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True,
                                                   "continuous_usage_stats": True}}) as s:
            chunks = _sse(s)
        assert len(chunks) >= 7
        prompt = chunks[-1]["usage"]["prompt_tokens"]
        assert prompt > 150
        done = []
        for c in chunks:
            u = c["usage"]
            assert u is not None and u["prompt_tokens"] == prompt, (path, c)
            assert u["total_tokens"] == prompt + u["completion_tokens"]
            done.append(u["completion_tokens"])
        assert done == sorted(done) and done[-1] == 6


@pytest.mark.timeout(240)
def test_chat_stream_cut_inside_an_emoji_never_sends_a_replacement_char(
        http: httpx.Client) -> None:
    answer = "Hi 😀🎉"
    texts: list[str] = []
    for max_tokens in range(1, 24):  # the grammar may spell the emojis byte by byte
        with http.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Greet me."}], "stream": True,
                "max_tokens": max_tokens, "temperature": 0,
                "structured_outputs": {"choice": [answer]}}) as s:
            chunks = _sse(s)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"])
        assert "\ufffd" not in text and answer.startswith(text), (max_tokens, text)
        texts.append(text)
        if text == answer:
            break
    assert texts[-1] == answer
    # some cut fell inside an emoji: one more token, no more text (its bytes held back)
    assert any(a == b and a for a, b in zip(texts, texts[1:], strict=False)), texts


@pytest.mark.timeout(120)
def test_logit_bias_and_seed_errors(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "logit_bias": {"5": 1, "x": 1, "-1": 2, "999999": 3}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "logit_bias"
    assert all(repr(k) in err["message"] for k in ("x", "-1", "999999"))
    for seed, kind in ((2**64, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")):
        r = http.post("/v1/completions", json={"prompt": "Hi", "seed": seed})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "seed" and kind in r.json()["error"]["message"]


#: family -> (a chat template that renders tools its way, a hand-written output, its content)
FAMILIES = {
    "mistral": ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
                "{% endif %}{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}",
                'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
                '"Oslo"}}]', "Checking. "),
    "pythonic": ("{% if tools %}Answer with [func_name(param=value)] to call:"
                 "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n{% endif %}"
                 "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}",
                 '[get_weather(city="Oslo")]', None),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_parser_through_a_server(tmp_path: Path, family: str) -> None:
    template, output, content = FAMILIES[family]
    (tmp_path / "t.jinja").write_text(template)
    s = ServerProcess(["--num-pages", "64", "--max-num-seqs", "4", "--chat-template",
                       str(tmp_path / "t.jinja"), "--enable-auto-tool-choice",
                       "--tool-call-parser", family], tmp_path)
    try:
        s.wait_ready()
        c = OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        kw = dict(model="SmolLM2-135M-Instruct", tools=[WEATHER], temperature=0,
                  max_tokens=60, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                  extra_body={"structured_outputs": {"choice": [output]}})
        ch = c.chat.completions.create(**kw).choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content == content
        (call,) = ch.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather", {"city": "Oslo"})
        if family == "mistral":
            assert len(call.id) == 9 and call.id.isalnum()
        text, calls, finish = "", [], None
        for chunk in c.chat.completions.create(**kw, stream=True):
            d = chunk.choices[0].delta
            text += d.content or ""
            calls += [(t.function.name, t.function.arguments) for t in d.tool_calls or []]
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and text == (content or "")
        assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Oslo"})]
    finally:
        s.stop()
