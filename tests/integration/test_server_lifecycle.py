"""Server process lifecycle and security defaults, with the null model (no weights: the engine
returns a fixed token instantly): API key, body limit, concurrency limit (one server shared by
those tests), SIGTERM/SIGINT shutdown, engine-core death, frontend death (each kills its own
server), and SIGTERM while the model loads (a server whose model load is held by the test).

No test asserts how fast something happens: each waits for the event itself, with a generous
timeout that only turns a hang into a failure (``server_utils.wait_until``)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_utils import HANG_TIMEOUT_S, ServerProcess, hold_load_env, pid_alive, wait_until

#: null model whose every step takes 2 ms: 8000 tokens keep a request in flight for ~16 s
NULL_ARGS = ["--null-model", "--null-step-ms", "2", "--num-pages", "2048"]
LONG = {"prompt": "Hello", "max_tokens": 8000, "ignore_eos": True, "stream": True}


def _start(tmp_path: Path, args: list[str] = (), env: dict[str, str] | None = None
           ) -> ServerProcess:
    srv = ServerProcess([*NULL_ARGS, *args], tmp_path, env)
    try:
        srv.wait_ready(timeout_s=180)
    except BaseException:
        srv.stop()
        raise
    return srv


class StreamReader(threading.Thread):
    """Reads one SSE stream to its end in the background; records what it saw."""

    def __init__(self, url: str, body: dict, headers: dict | None = None,
                 slow: bool = False) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers or {}
        #: while set, wait 5 ms per line so the stream is surely still in flight
        self.slow = threading.Event()
        if slow:
            self.slow.set()
        self.started_streaming = threading.Event()
        self.lines: list[str] = []
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=self.headers,
                              timeout=60) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.started_streaming.set()
                    if self.slow.is_set():
                        time.sleep(0.005)
        except BaseException as e:  # noqa: BLE001 - recorded for the test
            self.error = e
        finally:
            self.started_streaming.set()

    @property
    def saw_error_event(self) -> bool:
        return any(line.startswith('data: {"error"') for line in self.lines)


API_KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory):
    """One null-model server with an API key, a 4 KiB body limit and one request at a time,
    shared by the tests that do not stop it."""
    srv = _start(tmp_path_factory.mktemp("guarded"),
                 ["--max-request-bytes", "4096", "--max-concurrent-requests", "1"],
                 env={"RADIXSERVE_API_KEY": API_KEY})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.timeout(240)
def test_api_key_required_on_v1_only(guarded: ServerProcess) -> None:
    base = guarded.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(base + "/v1/models", headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(base + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401
    assert httpx.get(base + "/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(base + "/health").status_code == 200  # open without a key
    assert httpx.get(base + "/metrics").status_code == 200


@pytest.mark.timeout(240)
def test_body_limit_by_length_and_by_chunked_body(guarded: ServerProcess) -> None:
    base = guarded.base_url
    # body limit: by Content-Length, and by counting a chunked body
    r = httpx.post(base + "/v1/completions", headers=AUTH,
                   json={"prompt": "a" * 5000, "max_tokens": 1})
    assert r.status_code == 413 and r.json()["error"]["message"]

    def chunks():
        for _ in range(10):
            yield b" " * 1000
        yield b'{"prompt": "x"}'

    r = httpx.post(base + "/v1/completions", headers={**AUTH,
                   "content-type": "application/json"}, content=chunks())
    assert r.status_code == 413


@pytest.mark.timeout(240)
def test_concurrency_limit_and_slot_release(guarded: ServerProcess) -> None:
    base = guarded.base_url
    # concurrency limit: a second request while one streams gets 429
    with httpx.stream("POST", base + "/v1/completions", json=LONG, headers=AUTH,
                      timeout=60) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # keep it: a dropped iterator closes the connection
        assert next(lines).startswith("data: ")
        r = httpx.post(base + "/v1/completions", headers=AUTH,
                       json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    # the slot is released once the first stream is gone: wait for that event (the server
    # notices the closed connection asynchronously); 429 is the only other answer allowed

    def second_request_served() -> httpx.Response | None:
        r = httpx.post(base + "/v1/completions", headers=AUTH,
                       json={"prompt": "x", "max_tokens": 2})
        assert r.status_code in (200, 429), r.text
        return r if r.status_code == 200 else None

    r = wait_until(second_request_served, "the concurrency slot to be released",
                   interval_s=0.1)
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_shuts_down_cleanly(tmp_path: Path, sig: int) -> None:
    # no drain time: the running requests are aborted at once (test_production.py drains)
    srv = _start(tmp_path, ["--shutdown-timeout", "0"])
    try:
        engine = srv.engine_pid
        assert engine is not None and pid_alive(engine)
        assert srv.ipc_dirs(), "the IPC socket directory should exist while serving"
        readers = [StreamReader(srv.base_url + "/v1/completions", LONG, slow=True)
                   for _ in range(3)]
        for r in readers:
            r.start()
        for r in readers:
            assert r.started_streaming.wait(HANG_TIMEOUT_S)
        srv.proc.send_signal(sig)
        for r in readers:
            r.slow.clear()
        # the server exits by itself (no SIGKILL needed) with status 0, and (shutdown timeout
        # 0) does not wait for the in-flight requests to finish: each stream ends with an
        # error event (aborted), never silently truncated while the server claims success
        rc = srv.proc.wait(timeout=HANG_TIMEOUT_S)
        assert rc == 0, srv.log_tail()
        for r in readers:
            r.join(HANG_TIMEOUT_S)
            assert not r.is_alive()
            assert r.status == 200
            assert r.saw_error_event or r.error is not None, r.lines[-3:]
        wait_until(lambda: not pid_alive(engine), "the engine core to exit after the shutdown")
        assert srv.ipc_dirs() == [], "IPC socket files were left behind"
    finally:
        srv.stop()


@pytest.mark.timeout(240)
def test_engine_core_death_fails_requests_and_exits_nonzero(tmp_path: Path) -> None:
    srv = _start(tmp_path)
    try:
        engine = srv.engine_pid
        reader = StreamReader(srv.base_url + "/v1/completions", LONG, slow=True)
        reader.start()
        assert reader.started_streaming.wait(HANG_TIMEOUT_S)
        os.kill(engine, signal.SIGKILL)
        reader.slow.clear()

        wait_until(srv.health_failed, "/health to stop reporting a healthy server")
        rc = srv.proc.wait(timeout=HANG_TIMEOUT_S)
        assert rc != 0, srv.log_tail()
        reader.join(HANG_TIMEOUT_S)
        assert reader.saw_error_event or reader.error is not None
        assert not pid_alive(engine)
        assert srv.ipc_dirs() == []
    finally:
        srv.stop()


@pytest.mark.timeout(240)
def test_frontend_killed_engine_core_exits_too(tmp_path: Path) -> None:
    srv = _start(tmp_path)
    try:
        engine = srv.engine_pid
        srv.proc.kill()
        srv.proc.wait(HANG_TIMEOUT_S)
        wait_until(lambda: not pid_alive(engine),
                   "the engine core to exit after its frontend was killed (no orphan)")
        assert srv.ipc_dirs() == []
    finally:
        srv.stop()


@pytest.mark.timeout(240)
def test_sigterm_while_the_model_loads(tmp_path: Path) -> None:
    """The real default model's command line, but the test holds the engine core inside its
    model load (it never gets the release), so "while the model loads" is certain, not a race
    against a fast load."""
    hold = tmp_path / "hold"
    hold.mkdir()
    srv = ServerProcess(["--num-pages", "64"], tmp_path, env=hold_load_env(hold))
    try:
        loading = hold / "loading"
        wait_until(lambda: loading.exists() or srv.proc.poll() is not None,
                   "the engine core to start loading the model")
        assert srv.proc.poll() is None, srv.log_tail()
        engine = int(loading.read_text())

        def health_status() -> int | None:
            assert srv.proc.poll() is None, srv.log_tail()
            try:
                return httpx.get(srv.base_url + "/health", timeout=5).status_code
            except httpx.HTTPError:
                return None  # not listening yet

        status = wait_until(health_status, "the server to answer /health")
        assert status == 503, "the server must listen (and answer 503) while the model loads"
        engines = srv.child_pids()
        assert engine in engines
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(HANG_TIMEOUT_S) == 0, srv.log_tail()
        # SIGTERM interrupted the load itself (the load would never have finished by itself)
        assert (hold / "interrupted").exists(), srv.log_tail()
        assert not (hold / "release").exists()
        for pid in engines:
            wait_until(lambda pid=pid: not pid_alive(pid), f"child {pid} to exit")
        assert srv.ipc_dirs() == []
    finally:
        srv.stop()


@pytest.mark.timeout(240)
def test_responses_stream_cut_by_shutdown_ends_with_response_failed(tmp_path: Path) -> None:
    """A Responses stream the shutdown cuts ends with ``response.failed`` (status "failed",
    the reason in ``error``, the text so far in an incomplete message), never with
    ``response.completed``."""
    srv = _start(tmp_path, ["--shutdown-timeout", "0"])
    try:
        body = {"input": "Hello", "max_output_tokens": 8000, "ignore_eos": True, "stream": True}
        reader = StreamReader(srv.base_url + "/v1/responses", body, slow=True)
        reader.start()
        assert reader.started_streaming.wait(HANG_TIMEOUT_S)
        srv.proc.send_signal(signal.SIGTERM)
        reader.slow.clear()
        assert srv.proc.wait(timeout=HANG_TIMEOUT_S) == 0, srv.log_tail()
        reader.join(HANG_TIMEOUT_S)
        assert reader.status == 200 and reader.error is None, reader.error
        events = [json.loads(line[6:]) for line in reader.lines if line.startswith("data: ")]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        last = events[-1]
        assert last["type"] == "response.failed", reader.lines[-3:]
        resp = last["response"]
        assert resp["status"] == "failed" and resp["error"]["code"] == "server_error"
        assert "shut down" in resp["error"]["message"]
        (msg,) = resp["output"]
        assert msg["status"] == "incomplete" and msg["content"][0]["text"]
        assert not any(e["type"] == "response.completed" for e in events)
    finally:
        srv.stop()
