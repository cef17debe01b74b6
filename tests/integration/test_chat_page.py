"""The chat page at ``/``, end to end in headless Chromium driven by selenium, against a real
``radixserve serve`` with the null model (the default model's tokenizer and chat template, no
weights; each step sleeps, so an answer streams for long enough to be stopped).

Each test types a message, sees the answer grow while it streams, presses Stop, checks that the
answer stopped growing and that the server freed the request (nothing running, no KV page held
outside the radix cache), sends a second message that finishes, and saves a screenshot under
``tmp_path``. One runs with ``--api-key``: the page loads without the key, says it needs one,
and works once it is typed, while ``/v1/*`` stays closed to calls without it.

Chromium and chromedriver are Debian's (``make test`` installs them where missing); without
them the tests skip, except in CI (``CI`` set), where that is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import ServerProcess, wait_idle, wait_until

#: a 10 ms step: an answer of MAX_TOKENS tokens streams for 40 s or more, far longer than the
#: test needs before it presses Stop, yet the tokens visibly arrive one after another
NULL_ARGS = ["--null-model", "--null-step-ms", "10", "--num-pages", "512"]
MAX_TOKENS = 4000
#: how long the server may take to free a stopped request: well under the ~40 s the answer
#: would still run, so an abort that did not reach the engine fails the test
FREED_WITHIN_S = 10.0
API_KEY = "page-s3cret"
#: waits for something the page must show: only turns a hang into a failure
WAIT_S = 60.0

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


def _require_browser() -> None:
    if CHROMIUM and CHROMEDRIVER:
        return
    why = ("chromium and chromedriver are not installed (`make test` installs Debian's "
           "chromium and chromium-driver)")
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture
def driver() -> Iterator[object]:
    """A headless Chromium (Debian's, through its chromedriver: never a downloaded one)."""
    _require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(options=opts, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield drv
    finally:
        drv.quit()


def _start(factory: pytest.TempPathFactory, args: list[str]) -> ServerProcess:
    # a short folder of its own: the IPC socket paths under it must stay under ~100 bytes
    srv = ServerProcess([*NULL_ARGS, *args], factory.mktemp("chat"))
    try:
        srv.wait_ready(timeout_s=180)
    except BaseException:
        srv.stop()
        raise
    return srv


def _by_id(drv, element_id: str):
    from selenium.webdriver.common.by import By

    return drv.find_element(By.ID, element_id)


def _answers(drv) -> list:
    from selenium.webdriver.common.by import By

    return drv.find_elements(By.CSS_SELECTOR, "#messages .msg.assistant")


def _content(answer) -> str:
    from selenium.webdriver.common.by import By

    return answer.find_element(By.CLASS_NAME, "content").text


def _stats(answer) -> str:
    from selenium.webdriver.common.by import By

    return answer.find_element(By.CLASS_NAME, "stats").text


def _set(drv, element_id: str, value: str) -> None:
    field = _by_id(drv, element_id)
    field.clear()
    field.send_keys(value)


def _send(drv, text: str, max_tokens: int) -> object:
    """Type ``text`` with ``max_tokens``, press Send; return the new answer's element."""
    before = len(_answers(drv))
    _set(drv, "max-tokens", str(max_tokens))
    _set(drv, "prompt", text)
    _by_id(drv, "send").click()
    return wait_until(lambda: len(_answers(drv)) > before and _answers(drv)[-1],
                      "the answer's bubble", WAIT_S)


def _give_key(drv, key: str) -> None:
    """Type ``key`` into the API key field and wait for the page's next /v1/models answer."""
    from selenium.webdriver.common.by import By

    body = drv.find_element(By.TAG_NAME, "body")
    seen = int(body.get_attribute("data-model-checks") or 0)
    _set(drv, "api-key", key)
    _by_id(drv, "prompt").click()  # leaves the field: its change event asks /v1/models again
    wait_until(lambda: int(body.get_attribute("data-model-checks") or 0) > seen,
               "the page to check the key", WAIT_S)


def _chat_stream_stop_and_finish(drv, srv: ServerProcess, tmp_path: Path) -> None:
    """The page's whole round: stream, stop, check the server freed it, then a full answer."""
    _set(drv, "system", "You are a terse assistant.")
    _set(drv, "temperature", "0.5")
    answer = _send(drv, "Tell me a long story.", MAX_TOKENS)

    # streamed: the text is seen at two lengths while the answer is still running
    first = wait_until(lambda: _content(answer), "the first streamed text", WAIT_S)
    wait_until(lambda: len(_content(answer)) > len(first) + 5, "more streamed text", WAIT_S)
    assert answer.get_attribute("data-state") == "streaming"
    assert _by_id(drv, "send").get_property("disabled")

    _by_id(drv, "stop").click()
    wait_until(lambda: answer.get_attribute("data-state") == "stopped", "the stopped state",
               WAIT_S)
    stopped_text = _content(answer)
    stats = _stats(answer)
    assert re.search(r"TTFT \d+ ms", stats), stats
    assert re.search(r"\d+\.\d tok/s", stats), stats
    n = int(re.search(r"(\d+) tokens", stats).group(1))
    assert 1 < n < MAX_TOKENS, stats
    assert "stopped" in stats
    # the stop really closed the request: the server is idle again with every KV page back in
    # the radix cache (wait_idle), long before MAX_TOKENS tokens could have been generated
    wait_idle(srv.base_url, timeout_s=FREED_WITHIN_S)
    time.sleep(0.5)
    assert _content(answer) == stopped_text, "the answer kept growing after Stop"
    assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
    assert _by_id(drv, "stop").get_property("disabled")

    # the server still answers, and the page sends the conversation so far (the stopped answer
    # included): a second answer runs to its max tokens
    second = _send(drv, "Now a short one.", 8)
    wait_until(lambda: second.get_attribute("data-state") != "streaming", "the second answer",
               WAIT_S)
    assert second.get_attribute("data-state") == "done", _content(second)
    assert _content(second)
    stats = _stats(second)
    assert "8 tokens" in stats and "length" in stats and re.search(r"TTFT \d+ ms", stats)

    shot = tmp_path / "chat_page.png"
    assert drv.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # nothing failed in the page: no script error, no blocked (outside) resource
    bad = [e["message"] for e in drv.get_log("browser")
           if e["level"] == "SEVERE" and "/v1/models - Failed to load resource" not in
           e["message"]]
    assert not bad, bad


@pytest.mark.timeout(300)
def test_chat_page_streams_stops_and_frees_the_request(
        driver, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    srv = _start(tmp_path_factory, [])
    try:
        r = httpx.get(srv.base_url + "/", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in r.headers["content-security-policy"]
        driver.get(srv.base_url + "/")
        # the model's name comes from /v1/models
        model = httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        wait_until(lambda: _by_id(driver, "model").text == model, "the model's name", WAIT_S)
        _chat_stream_stop_and_finish(driver, srv, tmp_path)
    finally:
        srv.stop()


@pytest.mark.timeout(300)
def test_chat_page_behind_api_key(driver, tmp_path: Path,
                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    srv = _start(tmp_path_factory, ["--api-key", API_KEY])
    try:
        base = srv.base_url
        # the page and its files load without the key; the API does not
        for path in ("/", "/static/chat.js", "/static/chat.css"):
            assert httpx.get(base + path, timeout=10).status_code == 200, path
        assert httpx.get(base + "/v1/models", timeout=10).status_code == 401
        assert httpx.post(base + "/v1/chat/completions", timeout=10, json={
            "messages": [{"role": "user", "content": "x"}]}).status_code == 401

        driver.get(base + "/")
        wait_until(lambda: "API key" in _by_id(driver, "status").text,
                   "the page to ask for the API key", WAIT_S)
        assert _by_id(driver, "send").get_property("disabled")
        # a wrong key is refused the same way
        _give_key(driver, "wrong")
        assert "API key" in _by_id(driver, "status").text
        assert _by_id(driver, "send").get_property("disabled")

        _give_key(driver, API_KEY)
        model = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=10).json()["data"][0]["id"]
        wait_until(lambda: _by_id(driver, "model").text == model,
                   "the model's name once the key is given", WAIT_S)
        _chat_stream_stop_and_finish(driver, srv, tmp_path)
    finally:
        srv.stop()
