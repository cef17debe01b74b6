"""Running radixserve in production (issue 26), against real ``radixserve serve`` processes on
127.0.0.1 with the null model (no weights: the engine returns a fixed token, each step taking
2 ms) and the official ``openai`` client:

* request ids: ``X-Request-Id`` or the body's ``request_id`` names the request, is echoed in
  the response header, makes the response id (``cmpl-<id>``, ``chatcmpl-<id>``) and the
  engine ids in the log lines; a duplicate among running requests is a 400;
* logs: one line per finished request, a stats line per interval, JSON lines, the switches
  that turn them off, no prompt text unless ``--log-prompts``;
* generation defaults: ``--generation-config FOLDER`` fills the fields a request leaves unset;
* drain: SIGTERM stops admitting (503 with ``Retry-After``, /health "draining") while running
  streams finish; past ``--shutdown-timeout`` what still runs is aborted; exit status 0. The
  gRPC worker (``serve --grpc``) likewise, with its request ids and log lines.

No test asserts how fast something happens: each waits for the event itself
(``server_utils.wait_until``).
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_utils import GrpcWorker
from server_utils import HANG_TIMEOUT_S, ServerProcess, wait_until
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

#: null model whose every step takes 2 ms
NULL_ARGS = ["--null-model", "--null-step-ms", "2", "--num-pages", "2048"]
MODEL = "SmolLM2-135M-Instruct"
SECRET_PROMPT = "my secret prompt text"


def _start(tmp_path: Path, args: list[str] = ()) -> ServerProcess:
    return _start_all([(tmp_path, args)])[0]


def _start_all(specs: list[tuple[Path, list[str]]]) -> list[ServerProcess]:
    """A null-model server per ``(workdir, args)``, all launched before any is waited for:
    start-up is mostly single-threaded imports, so two start in about the time of one."""
    servers = [ServerProcess([*NULL_ARGS, *args], workdir) for workdir, args in specs]
    try:
        for srv in servers:
            srv.wait_ready(timeout_s=180)
    except BaseException:
        for srv in servers:
            srv.stop()
        raise
    return servers


def _client(srv: ServerProcess) -> openai.OpenAI:
    # no retries: a 503 must be seen as it is, not retried after its Retry-After
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=HANG_TIMEOUT_S)


def _log_lines(srv: ServerProcess) -> list[str]:
    return srv.log_path.read_text(errors="replace").splitlines()


def _request_lines(srv: ServerProcess) -> list[str]:
    return [ln for ln in _log_lines(srv) if "radixserve.requests" in ln]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory):
    """One null-model server with default logging, stats every 0.3 s."""
    s = _start(tmp_path_factory.mktemp("prod"), ["--log-stats-interval", "0.3"])
    try:
        yield s
    finally:
        s.stop()


def _maps_torch(pid: int) -> bool:
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


def test_api_process_leaves_torch_to_the_engine(srv) -> None:
    """The API process tokenizes with the class the engine names, so it never imports torch
    (~250 MiB resident); the engine process does."""
    reply = _client(srv).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert reply.usage.prompt_tokens > 3 and reply.choices[0].message.content
    assert srv.engine_pid is not None and _maps_torch(srv.engine_pid)
    assert not _maps_torch(srv.proc.pid)


# -- request ids ---------------------------------------------------------------------------------


def test_client_request_id_names_response_header_and_engine_requests(srv) -> None:
    c = _client(srv)
    raw = c.completions.with_raw_response.create(
        model=MODEL, prompt="Hello", max_tokens=3, extra_headers={"X-Request-Id": "abc-123"})
    assert raw.headers["x-request-id"] == "abc-123"
    assert raw.parse().id == "cmpl-abc-123"
    # the body's request_id (vLLM's field) when no header names the request
    raw = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2,
        extra_body={"request_id": "from-body"})
    assert raw.headers["x-request-id"] == "from-body"
    assert raw.parse().id == "chatcmpl-from-body"
    # the header wins over the body
    raw = c.completions.with_raw_response.create(
        model=MODEL, prompt="Hello", max_tokens=1, extra_headers={"X-Request-Id": "hdr"},
        extra_body={"request_id": "body"})
    assert raw.headers["x-request-id"] == "hdr" and raw.parse().id == "cmpl-hdr"
    # no id given: a fresh one, echoed and in the response id
    raw = c.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=1)
    rid = raw.headers["x-request-id"]
    assert len(rid) == 32 and raw.parse().id == f"cmpl-{rid}"
    # streamed: every chunk carries the id
    raw = c.completions.with_raw_response.create(
        model=MODEL, prompt="Hello", max_tokens=3, stream=True,
        extra_headers={"X-Request-Id": "streamed-1"})
    assert raw.headers["x-request-id"] == "streamed-1"
    assert {ch.id for ch in raw.parse()} == {"cmpl-streamed-1"}
    # the engine's ids are the client's: one request keeps it, n children get "-k"
    lines = wait_until(lambda: [ln for ln in _request_lines(srv)
                                if "from-body-1:" in ln], "the request log line")
    assert "finished request from-body-1:" in lines[0]
    text = "\n".join(_request_lines(srv))
    for name in ("abc-123:", "from-body-0:", "hdr:", f"{rid}:", "streamed-1:"):
        assert f"finished request {name}" in text


def test_duplicate_running_request_id_is_a_400(srv) -> None:
    c = _client(srv)
    # n=2: engine requests "dup-0" and "dup-1"
    stream = c.completions.create(model=MODEL, prompt="Hello", max_tokens=8000, n=2,
                                  stream=True, extra_body={"ignore_eos": True},
                                  extra_headers={"X-Request-Id": "dup"})
    next(iter(stream))  # it runs
    for create in (lambda **kw: c.completions.create(prompt="x", **kw),
                   lambda **kw: c.chat.completions.create(
                       messages=[{"role": "user", "content": "x"}], **kw)):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, max_tokens=1, extra_headers={"X-Request-Id": "dup"})
        err = e.value.response.json()["error"]
        assert err["param"] == "request_id" and err["code"] == "duplicate_request_id"
        assert err["type"] == "invalid_request_error" and "dup" in err["message"]
        assert e.value.response.headers["x-request-id"] == "dup"
    # an id equal to a running request's child id is refused too
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=1,
                             extra_headers={"X-Request-Id": "dup-1"})
    assert e.value.response.json()["error"]["code"] == "duplicate_request_id"
    stream.close()  # the client leaves: the id is free again once the server saw it

    def reusable() -> bool:
        try:
            c.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                 extra_headers={"X-Request-Id": "dup"})
        except openai.BadRequestError:
            return False
        return True

    wait_until(reusable, "the id to be free after its request ended", interval_s=0.1)


@pytest.mark.parametrize("rid", ["", "x" * 257, "bad\u00e9id", " padded"])
def test_malformed_request_id_is_a_400(srv, rid: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _client(srv).completions.create(model=MODEL, prompt="x", max_tokens=1,
                                        extra_body={"request_id": rid})
    assert e.value.response.json()["error"]["param"] == "request_id"


# -- logs ----------------------------------------------------------------------------------------


def test_request_and_stats_lines(srv) -> None:
    c = _client(srv)
    r = c.completions.create(model=MODEL, prompt=SECRET_PROMPT, max_tokens=40,
                             extra_headers={"X-Request-Id": "logged-1"})
    assert r.usage.completion_tokens == 40
    line = wait_until(lambda: next((ln for ln in _request_lines(srv)
                                    if "logged-1:" in ln), None), "the request line")
    prompt_tokens = r.usage.prompt_tokens
    for part in (f"prompt_tokens={prompt_tokens}", "cached_tokens=", "output_tokens=40",
                 "ttft_s=", "e2e_s=", "finish_reason=length"):
        assert part in line, line
    # a stats line with the rates and occupancy, logged while there was work
    stats = wait_until(lambda: [ln for ln in _log_lines(srv) if "radixserve.stats" in ln],
                       "a stats line")
    for part in ("prompt ", "tok/s", "generation ", "running ", "waiting ", "KV use ",
                 "prefix hit rate "):
        assert part in stats[0], stats[0]
    # never the prompt text unless --log-prompts
    assert SECRET_PROMPT not in srv.log_path.read_text(errors="replace")


@pytest.mark.timeout(300)
def test_json_logs(tmp_path: Path) -> None:
    """JSON lines with --log-prompts; nothing with the switches off."""
    quiet, loud = _start_all([
        (tmp_path / "q", ["--disable-log-requests", "--disable-log-stats",
                          "--log-stats-interval", "0.2"]),
        (tmp_path / "j", ["--log-format", "json", "--log-prompts", "--log-stats-interval",
                          "0.2"])])
    try:
        for s in (quiet, loud):
            _client(s).completions.create(model=MODEL, prompt=SECRET_PROMPT, max_tokens=100,
                                          extra_headers={"X-Request-Id": "j1"})

        def request_record() -> dict | None:
            for ln in _log_lines(loud):
                if ln.startswith("{") and '"radixserve.requests"' in ln:
                    return json.loads(ln)
            return None

        rec = wait_until(request_record, "the JSON request line")
        assert rec["request_id"] == "j1" and rec["output_tokens"] == 100
        assert rec["finish_reason"] == "length" and rec["level"] == "INFO"
        assert rec["prompt"] == SECRET_PROMPT  # --log-prompts
        assert {"prompt_tokens", "cached_tokens", "ttft_s", "e2e_s", "time"} <= set(rec)
        stats = wait_until(lambda: [json.loads(ln) for ln in _log_lines(loud)
                                    if ln.startswith("{") and '"radixserve.stats"' in ln],
                           "a JSON stats line")
        assert {"prompt_tokens_per_s", "generation_tokens_per_s", "running", "waiting",
                "kv_use", "prefix_hit_rate"} <= set(stats[0])
        # every line of the JSON server is JSON, the engine core's and uvicorn's included
        lines = [ln for ln in _log_lines(loud) if ln.strip()]
        assert all(ln.startswith("{") for ln in lines), [ln for ln in lines
                                                         if not ln.startswith("{")][:3]
        assert any(json.loads(ln)["logger"] == "radixserve.engine" for ln in lines)
        # the disabled server logs neither
        text = quiet.log_path.read_text(errors="replace")
        assert "radixserve.requests" not in text and "radixserve.stats" not in text
        assert SECRET_PROMPT not in text
    finally:
        quiet.stop()
        loud.stop()


# -- drain ---------------------------------------------------------------------------------------


class Streamer(threading.Thread):
    """One streamed completion read to its end with the openai client, in the background."""

    def __init__(self, srv: ServerProcess, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client = _client(srv)
        self.max_tokens = max_tokens
        self.started = threading.Event()
        self.tokens = 0
        self.finish_reason: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for ch in self.client.completions.create(
                    model=MODEL, prompt="Hello", max_tokens=self.max_tokens, stream=True,
                    extra_body={"ignore_eos": True}):
                self.started.set()
                self.tokens += 1
                if ch.choices and ch.choices[0].finish_reason:
                    self.finish_reason = ch.choices[0].finish_reason
        except BaseException as e:  # noqa: BLE001 - recorded for the test
            self.error = e
        finally:
            self.started.set()


@pytest.mark.timeout(300)
def test_sigterm_drains_running_streams_and_refuses_new_requests(tmp_path: Path) -> None:
    srv = _start(tmp_path, ["--shutdown-timeout", "120"])
    try:
        # ~1500 steps of 2 ms each: still running when the signal comes
        streams = [Streamer(srv, 1500) for _ in range(3)]
        for s in streams:
            s.start()
        for s in streams:
            assert s.started.wait(HANG_TIMEOUT_S)
        srv.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(srv.base_url + "/health", timeout=5).status_code == 503,
                   "/health to turn 503")
        h = httpx.get(srv.base_url + "/health", timeout=5)
        assert h.json()["status"] == "draining" and h.headers["retry-after"] == "1"
        if any(s.is_alive() for s in streams):
            # a new request while draining: 503, OpenAI body, Retry-After
            with pytest.raises(openai.APIStatusError) as e:
                _client(srv).completions.create(model=MODEL, prompt="x", max_tokens=1)
            assert e.value.status_code == 503
            assert e.value.response.headers["retry-after"] == "1"
            assert e.value.response.json()["error"]["type"] == "service_unavailable_error"
            assert "draining" in e.value.response.json()["error"]["message"]
        rc = srv.proc.wait(timeout=HANG_TIMEOUT_S)
        assert rc == 0, srv.log_tail()
        for s in streams:  # every running stream ran to its end
            s.join(HANG_TIMEOUT_S)
            assert s.error is None and s.finish_reason == "length", (s.error, s.tokens)
        assert "drained: no request running" in srv.log_tail(20000)
    finally:
        srv.stop()


@pytest.mark.timeout(300)
def test_shutdown_timeout_aborts_what_still_runs(tmp_path: Path) -> None:
    srv = _start(tmp_path, ["--shutdown-timeout", "0.5"])
    try:
        # 8000 steps of 2 ms or more: far beyond the timeout
        long = Streamer(srv, 8000)
        long.start()
        assert long.started.wait(HANG_TIMEOUT_S)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=HANG_TIMEOUT_S) == 0, srv.log_tail()
        long.join(HANG_TIMEOUT_S)
        # the stream ends with finish_reason "abort", then an error event saying why: never
        # silently truncated
        assert long.finish_reason == "abort"
        assert isinstance(long.error, openai.APIError), long.error
        assert "shut down before the request finished" in str(long.error)
        assert "aborting 1 running requests" in srv.log_tail(20000)
    finally:
        srv.stop()


@pytest.mark.timeout(300)
def test_grpc_worker_ids_logs_and_drain(tmp_path: Path) -> None:
    w = GrpcWorker([*NULL_ARGS, "--shutdown-timeout", "120", "--log-format", "json"],
                   tmp_path)
    try:
        w.wait_ready(timeout_s=180)
        stub = w.stub()

        def gen(rid: str, max_tokens: int, n: int = 1, stream: bool = False):
            return stub.Generate(pb.GenerateRequest(
                request_id=rid, tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                sampling_params=pb.SamplingParams(max_tokens=max_tokens, n=n,
                                                  ignore_eos=True), stream=stream),
                timeout=HANG_TIMEOUT_S)

        done = [r for r in gen("g1", 4, n=2) if r.WhichOneof("response") == "complete"]
        assert len(done) == 2
        # the gateway's id names the engine requests (engine_types.fan_out) in the log
        recs = wait_until(lambda: [json.loads(ln) for ln in w.log_path.read_text().splitlines()
                                   if '"radixserve.requests"' in ln], "gRPC request lines")
        assert {r["request_id"] for r in recs} == {"g1-0", "g1-1"}
        assert all(r["output_tokens"] == 4 and r["finish_reason"] == "length" for r in recs)
        # JSON lines only: the worker's, its engine core's and its side port's uvicorn
        lines = [ln for ln in w.log_path.read_text().splitlines() if ln.strip()]
        assert all(ln.startswith("{") for ln in lines), [ln for ln in lines
                                                         if not ln.startswith("{")][:3]
        # a stream runs when SIGTERM comes: it finishes, new calls are refused meanwhile
        call = gen("long", 1500, stream=True)
        it = iter(call)
        next(it)
        w.proc.send_signal(signal.SIGTERM)
        health = wait_until(lambda: (h := stub.HealthCheck(pb.HealthCheckRequest()))
                            and not h.healthy and h, "HealthCheck to turn unhealthy")
        assert health.message == "draining"
        assert httpx.get(w.metrics_url + "/health", timeout=5).json()["status"] == "draining"
        if not call.done():
            with pytest.raises(grpc.RpcError) as e:
                list(gen("late", 1))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in e.value.details()
        rest = list(it)  # the running stream ends normally
        assert rest[-1].WhichOneof("response") == "complete"
        assert rest[-1].complete.finish_reason == "length"
        assert w.proc.wait(HANG_TIMEOUT_S) == 0, w.log_tail()
        assert "drained: no request running" in w.log_tail(20000)
    finally:
        w.stop()


# -- generation defaults -------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_generation_config_folder_sets_defaults(tmp_path: Path, srv) -> None:
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps(
        {"max_new_tokens": 7, "temperature": 0.5, "top_k": 50}))
    # a folder without the file, refused at start-up (checked below), started alongside
    bad = ServerProcess([*NULL_ARGS, "--generation-config", str(tmp_path / "nope")],
                        tmp_path / "b")
    s = None
    try:
        s = _start(tmp_path / "s", ["--generation-config", str(gen)])
        c = _client(s)
        msgs = [{"role": "user", "content": "hi"}]
        # the model's max_new_tokens where the request gives no maximum
        assert c.chat.completions.create(model=MODEL, messages=msgs).usage \
            .completion_tokens == 7
        assert c.completions.create(model=MODEL, prompt="x").usage.completion_tokens == 7
        assert c.completions.create(model=MODEL, prompt="x", max_tokens=3).usage \
            .completion_tokens == 3
        # the start-up log names them (top_k 50 is Hugging Face's default: not one)
        assert "sampling defaults from the model's generation config (--generation-config " \
               f"{gen}; `--generation-config vllm` ignores them): temperature=0.5, " \
               "max_tokens=7" in s.log_path.read_text()
        s.stop()
        # the default model's folder recommends nothing: OpenAI's 16 for a completion
        assert _client(srv).completions.create(model=MODEL, prompt="x").usage \
            .completion_tokens == 16
        # the folder without the file: refused, naming it
        assert bad.proc.wait(HANG_TIMEOUT_S) == 1
        assert "no generation_config.json in that folder" in bad.log_tail()
    finally:
        if s is not None:
            s.stop()
        bad.stop()
