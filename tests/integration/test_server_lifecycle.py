"""Server process lifecycle and security defaults, with the null model (no weights: the engine
returns a fixed token instantly) so each test can afford its own server: API key, body limit,
concurrency limit, SIGTERM/SIGINT shutdown, engine-core death."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess, pid_alive

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


@pytest.mark.timeout(240)
def test_api_key_body_limit_and_concurrency_limit(tmp_path: Path) -> None:
    srv = _start(tmp_path, ["--max-request-bytes", "4096", "--max-concurrent-requests", "1"],
                 env={"RADIXSERVE_API_KEY": "s3cret"})
    try:
        base = srv.base_url
        auth = {"Authorization": "Bearer s3cret"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.get(base + "/v1/models", headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
            r = httpx.post(base + "/v1/completions", json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401
        assert httpx.get(base + "/v1/models", headers=auth).status_code == 200
        assert httpx.get(base + "/health").status_code == 200  # open without a key
        assert httpx.get(base + "/metrics").status_code == 200
        # body limit: by Content-Length, and by counting a chunked body
        r = httpx.post(base + "/v1/completions", headers=auth,
                       json={"prompt": "a" * 5000, "max_tokens": 1})
        assert r.status_code == 413 and r.json()["error"]["message"]

        def chunks():
            for _ in range(10):
                yield b" " * 1000
            yield b'{"prompt": "x"}'

        r = httpx.post(base + "/v1/completions", headers={**auth,
                       "content-type": "application/json"}, content=chunks())
        assert r.status_code == 413
        # concurrency limit: a second request while one streams gets 429
        with httpx.stream("POST", base + "/v1/completions", json=LONG, headers=auth,
                          timeout=60) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # keep it: a dropped iterator closes the connection
            assert next(lines).startswith("data: ")
            r = httpx.post(base + "/v1/completions", headers=auth,
                           json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        # the slot is released once the first stream is gone
        deadline = time.monotonic() + 10
        while True:
            r = httpx.post(base + "/v1/completions", headers=auth,
                           json={"prompt": "x", "max_tokens": 2})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_shuts_down_cleanly(tmp_path: Path, sig: int) -> None:
    srv = _start(tmp_path)
    try:
        engine = srv.engine_pid
        assert engine is not None and pid_alive(engine)
        assert srv.ipc_dirs(), "the IPC socket directory should exist while serving"
        readers = [StreamReader(srv.base_url + "/v1/completions", LONG, slow=True)
                   for _ in range(3)]
        for r in readers:
            r.start()
        for r in readers:
            assert r.started_streaming.wait(30)
        t0 = time.monotonic()
        srv.proc.send_signal(sig)
        for r in readers:
            r.slow.clear()
        rc = srv.proc.wait(timeout=15)
        elapsed = time.monotonic() - t0
        assert rc == 0, srv.log_tail()
        assert elapsed < 10, f"shutdown took {elapsed:.1f} s"
        for r in readers:
            r.join(10)
            assert not r.is_alive()
            assert r.status == 200
            # an in-flight stream ends with an error event (aborted), never silently truncated
            # while the server claims success
            assert r.saw_error_event or r.error is not None, r.lines[-3:]
        deadline = time.monotonic() + 5
        while pid_alive(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(engine), "the engine-core process survived the shutdown"
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
        assert reader.started_streaming.wait(30)
        os.kill(engine, signal.SIGKILL)
        reader.slow.clear()
        health_failed = False
        deadline = time.monotonic() + 10
        while srv.proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(srv.base_url + "/health", timeout=1).status_code == 503:
                    health_failed = True
            except httpx.HTTPError:
                health_failed = True  # already stopped listening
            time.sleep(0.05)
        rc = srv.proc.wait(timeout=5)
        assert rc != 0, srv.log_tail()
        assert health_failed
        reader.join(10)
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
        srv.proc.wait(10)
        deadline = time.monotonic() + 10
        while pid_alive(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(engine), "the engine core outlived its frontend (orphan)"
        assert srv.ipc_dirs() == []
    finally:
        srv.stop()


@pytest.mark.timeout(240)
def test_sigterm_while_the_model_loads(tmp_path: Path) -> None:
    srv = ServerProcess(["--num-pages", "64"], tmp_path)  # the real default model
    try:
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and srv.proc.poll() is None:
            try:
                status = httpx.get(srv.base_url + "/health", timeout=1).status_code
            except httpx.HTTPError:
                status = None
            if status is not None:
                break
            time.sleep(0.05)
        assert status == 503, "the server must listen (and answer 503) while the model loads"
        engines = srv.child_pids()
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(15) == 0, srv.log_tail()
        assert time.monotonic() - t0 < 10
        for pid in engines:
            assert not pid_alive(pid)
        assert srv.ipc_dirs() == []
    finally:
        srv.stop()
