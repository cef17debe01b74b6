"""Prefill/decode disaggregation end to end: real ``radixserve serve`` processes on 127.0.0.1 (a
prefill and a decode instance per connector) behind the real ``vllm-router`` (PyPI
``vllm-router``, ``--vllm-pd-disaggregation``), driven by the official ``openai`` package.

Both connectors run: ``NixlConnector`` (NIXL over UCX, installed by the Makefile's ``pd``
extra) and ``TcpConnector``. Every PD server checks its KV invariants after each engine step
(``RADIXSERVE_CHECK_INTEGRITY=1``: a broken invariant kills the engine and fails the tests);
each test ends with both sides idle: no request, no held page, every used page a cached one.
Reference outputs come from the offline ``LLM`` (float32, computing every prompt itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI
from server_utils import ServerProcess, free_ports, wait_idle, wait_until

from radixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8
PD_ARGS = ["--dtype", "float32", "--num-pages", "400", "--max-num-seqs", "32", "--seed", "0"]
INTEGRITY_ENV = {"RADIXSERVE_CHECK_INTEGRITY": "1"}


# ---------------------------------------------------------------------------- processes
def kv_config(connector: str, role: str, **extra: object) -> str:
    cfg: dict[str, object] = {"kv_connector": connector, "kv_role": role}
    lease = extra.pop("kv_lease_s", None)
    if lease is not None:
        cfg["kv_lease_s"] = lease
    if extra:
        cfg["kv_connector_extra_config"] = extra
    import json

    return json.dumps(cfg)


class RouterProcess:
    """``vllm-router --vllm-pd-disaggregation`` in front of one prefill and one decode server."""

    def __init__(self, prefill: str, decode: str, workdir: Path) -> None:
        exe = Path(sys.executable).parent / "vllm-router"
        assert exe.exists(), "vllm-router is missing: `make test` installs it (test extra)"
        self.port, metrics_port = free_ports(2)
        self._log = open(workdir / "router.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(exe), "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
             "--host", "127.0.0.1", "--port", str(self.port), "--policy", "round_robin",
             "--worker-startup-check-interval", "1", "--log-level", "warning",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, "vllm-router exited"
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(self.base_url + "/health", timeout=2).status_code == 200
            return False

        wait_until(up, "vllm-router to be ready", timeout_s=120, interval_s=0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


@dataclass
class PDPair:
    prefill: ServerProcess
    decode: ServerProcess
    router: RouterProcess

    def client(self) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=self.router.base_url + "/v1", api_key="x", timeout=300,
                           max_retries=0)


def start_server(workdir: Path, connector: str, role: str, extra: dict) -> ServerProcess:
    """A PD server of ``role``, ready (stopped again if it fails to start)."""
    srv = ServerProcess([*PD_ARGS, "--kv-transfer-config", kv_config(connector, role, **extra)],
                        workdir, env=INTEGRITY_ENV)
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory):
    """Both pairs. TCP: short leases (expiry is tested) and a load delay on the decode side (a
    window for aborts during a transfer). The four servers start one after another: loading
    the model is partly multi-threaded, and four loads at once on two cores took longer than
    four in turn (measured: 64 s and 123 CPU-s at once, 36 s and 59 CPU-s in turn)."""
    root = tmp_path_factory.mktemp("pd")
    specs = {"nixl": ("NixlConnector", {}, {"side_channel_timeout_s": 2}),
             "tcp": ("TcpConnector", {"kv_lease_s": 10},
                     {"side_channel_timeout_s": 2, "load_delay_s": 0.5})}
    servers: list[ServerProcess] = []
    made: dict[str, PDPair] = {}
    try:
        for name, (connector, prefill_extra, decode_extra) in specs.items():
            p = start_server(root / name / "prefill", connector, "kv_producer", prefill_extra)
            servers.append(p)
            d = start_server(root / name / "decode", connector, "kv_consumer", decode_extra)
            servers.append(d)
            made[name] = PDPair(p, d, RouterProcess(p.base_url, d.base_url, root / name))
        for pair in made.values():
            pair.router.wait_ready()
        yield made
    finally:
        for pair in made.values():
            pair.router.stop()
        for srv in servers:
            srv.stop()


# ---------------------------------------------------------------------------- helpers
def metric(base_url: str, name: str, **labels: str) -> float:
    """One sample of ``/metrics`` (``radixserve:`` + name) whose labels include ``labels``;
    0 when absent."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    want = "radixserve:" + name
    for line in text.splitlines():
        if not line.startswith(want):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != want:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return 0.0


def local_compute(base_url: str) -> float:
    return metric(base_url, "prompt_tokens_by_source_total", source="local_compute")


def chats(seed: int, n: int = 16) -> list[list[dict]]:
    """``n`` distinct chats whose prompts are 200+ tokens."""
    out = []
    for i in range(n):
        k = seed * 100 + i
        facts = " ".join(f"Item {k}-{j}: the {['red', 'blue', 'green', 'old'][j % 4]} box "
                         f"number {j * 7 + k} holds {j + k} stones." for j in range(14))
        out.append([{"role": "system", "content": f"You keep an inventory. {facts}"},
                    {"role": "user", "content": f"Which box holds {k + 3} stones? Be brief."}])
    return out


def reference(llm, convs: list[list[dict]]) -> list[tuple[str, str]]:
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


async def ask_all(client: AsyncOpenAI, convs: list[list[dict]], **kw) -> list:
    async with client:
        return await asyncio.gather(*[
            client.chat.completions.create(model=MODEL, messages=c, temperature=0,
                                           max_tokens=MAX_TOKENS, **kw) for c in convs])


async def stream_text(client: AsyncOpenAI, conv: list[dict]) -> str:
    """The greedy answer to ``conv``, streamed, as one text (the client is closed after)."""
    async with client as c:
        chunks = await c.chat.completions.create(model=MODEL, messages=conv, temperature=0,
                                                 max_tokens=MAX_TOKENS, stream=True)
        return "".join([ch.choices[0].delta.content or "" async for ch in chunks
                        if ch.choices])


def post_chat(base_url: str, conv: list[dict], **body) -> httpx.Response:
    return httpx.post(base_url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": conv, "temperature": 0, "max_tokens": MAX_TOKENS, **body})


def prefill_params(pair: PDPair, conv: list[dict]) -> dict:
    """The router's first leg by hand: one token on the prefill server."""
    r = post_chat(pair.prefill.base_url, conv, max_tokens=1, min_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    return params


def prefill_all(pair: PDPair, convs: list[list[dict]]) -> list[dict]:
    """``prefill_params`` for every chat, concurrently (the prefill server batches them)."""
    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as c:
            rs = await asyncio.gather(*[c.post(
                pair.prefill.base_url + "/v1/chat/completions", json={
                    "model": MODEL, "messages": conv, "temperature": 0, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True}}) for conv in convs])
        for r in rs:
            assert r.status_code == 200, r.text
        return [r.json()["kv_transfer_params"] for r in rs]

    return asyncio.run(run())


def settle(pair: PDPair, leases: bool = True) -> None:
    """Both sides idle: no request, no held page, every used page a cached one."""
    servers = [pair.decode] + ([pair.prefill] if leases else [])
    for srv in servers:
        wait_until(lambda s=srv: metric(s.base_url, "kv_transfer_held_pages") == 0,
                   f"{srv.base_url} to release its held pages", timeout_s=60)
        wait_idle(srv.base_url, timeout_s=30)
        assert srv.proc.poll() is None, srv.log_tail()


# ---------------------------------------------------------------------------- tests
@pytest.mark.timeout(600)
@pytest.mark.parametrize("connector", ["nixl", "tcp"])
def test_router_chats_equal_a_colocated_server(pairs, default_llm, connector: str) -> None:
    pair = pairs[connector]
    # 8 concurrent chats: twice the decode side's load threads (kv_transfer.worker's
    # LOAD_THREADS = 4), so loads queue behind one another. Every prompt is computed twice
    # (prefill server, offline reference) on a compute-bound 2-core machine: 16 took twice as
    # long and checked nothing more
    convs = chats(seed=1 if connector == "nixl" else 2, n=8)
    want = reference(default_llm, convs)
    d = pair.decode.base_url
    before = (local_compute(d), metric(d, "kv_transfer_loads_ok_total"),
              metric(d, "kv_transfer_pages_read_total"))
    got = asyncio.run(ask_all(pair.client(), convs))
    for w, r in zip(want, got, strict=True):
        assert r.usage.prompt_tokens >= 200
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == w
    after = (local_compute(d), metric(d, "kv_transfer_loads_ok_total"),
             metric(d, "kv_transfer_pages_read_total"))
    # the decode side computed one prompt token per request (the last, which samples the first
    # output token); everything else was read from the prefill side
    assert after[0] - before[0] <= len(convs)
    assert after[1] - before[1] == len(convs)
    assert after[2] - before[2] >= len(convs) * 12
    # a streamed answer through the router is the same text
    assert asyncio.run(stream_text(pair.client(), convs[0])) == want[0][0]
    settle(pair)
    assert metric(pair.prefill.base_url, "kv_transfer_leases_released_total") >= len(convs) + 1


@pytest.mark.timeout(300)
def test_with_a_shared_prefix_cached_on_decode_only_missing_pages_are_read(
        pairs, default_llm) -> None:
    pair = pairs["nixl"]
    d = pair.decode.base_url
    system = {"role": "system", "content": "You answer questions about a long list. " + " ".join(
        f"Entry {j}: the code word for {j} is {'abcdefgh'[j % 8]}{j * 13}." for j in range(30))}
    first = [system, {"role": "user", "content": "What is the code word for 4?"}]
    second = [system, {"role": "user", "content": "What is the code word for 17? Be brief."}]
    # the decode instance computes the first chat itself: the system prompt is now cached there
    r = post_chat(d, first)
    assert r.status_code == 200, r.text
    hits, pages = metric(d, "prefix_cache_hits_total"), metric(d, "kv_transfer_pages_read_total")
    resp = asyncio.run(ask_all(pair.client(), [second]))[0]
    assert (resp.choices[0].message.content, resp.choices[0].finish_reason) == \
        reference(default_llm, [second])[0]
    hit = metric(d, "prefix_cache_hits_total") - hits
    read = metric(d, "kv_transfer_pages_read_total") - pages
    n = resp.usage.prompt_tokens
    assert hit >= 16 * 10 and hit % 16 == 0
    # positions 0 .. n-2 are needed; the cached pages were not read again
    assert read == -(-(n - 1) // 16) - hit // 16
    settle(pair)


@pytest.mark.timeout(300)
def test_lease_expiry_frees_prefill_pages(pairs, default_llm) -> None:
    pair = pairs["tcp"]  # kv_lease_s 10
    p, d = pair.prefill.base_url, pair.decode.base_url
    conv = chats(seed=3, n=1)[0]
    expired = metric(p, "kv_transfer_leases_expired_total")
    params = prefill_params(pair, conv)
    assert metric(p, "kv_transfer_held_pages") == len(params["remote_block_ids"])
    # nobody reads: the prefill side frees the pages at expiry
    wait_until(lambda: metric(p, "kv_transfer_held_pages") == 0, "the lease to expire",
               timeout_s=60, interval_s=0.1)
    assert metric(p, "kv_transfer_leases_expired_total") == expired + 1
    wait_idle(p)
    # a decode request arriving after expiry cannot claim the pages: it recomputes the prompt
    failed, computed = metric(d, "kv_transfer_loads_failed_total"), local_compute(d)
    r = post_chat(d, conv, kv_transfer_params=params)
    assert r.status_code == 200, r.text
    assert (r.json()["choices"][0]["message"]["content"],
            r.json()["choices"][0]["finish_reason"]) == reference(default_llm, [conv])[0]
    assert metric(d, "kv_transfer_loads_failed_total") == failed + 1
    assert local_compute(d) - computed == r.json()["usage"]["prompt_tokens"]
    settle(pair)


@pytest.mark.timeout(300)
def test_client_abort_during_the_transfer_frees_pages_on_both_sides(pairs) -> None:
    pair = pairs["tcp"]  # the decode side's loads wait 0.5 s before reading
    p, d = pair.prefill.base_url, pair.decode.base_url
    conv = chats(seed=4, n=1)[0]
    params = prefill_params(pair, conv)
    released = metric(p, "kv_transfer_leases_released_total")
    aborted = metric(d, "request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(d + "/v1/chat/completions", timeout=0.2, json={
            "model": MODEL, "messages": conv, "max_tokens": MAX_TOKENS,
            "kv_transfer_params": params})
    wait_until(lambda: metric(d, "request_success_total", finished_reason="abort") > aborted,
               "the decode server to abort the request")
    wait_until(lambda: metric(p, "kv_transfer_leases_released_total") == released + 1,
               "the prefill side's lease to be released")
    settle(pair)


@pytest.mark.timeout(300)
def test_incompatible_pair_is_refused_and_decode_recomputes(pairs, default_llm) -> None:
    tcp, nixl = pairs["tcp"], pairs["nixl"]
    conv = chats(seed=5, n=1)[0]
    params = prefill_params(tcp, conv)  # a TcpConnector prefill instance ...
    d = nixl.decode  # ... read by a NixlConnector decode instance: refused at handshake
    failed = metric(d.base_url, "kv_transfer_loads_failed_total")
    r = post_chat(d.base_url, conv, kv_transfer_params=params)
    assert r.status_code == 200, r.text
    assert (r.json()["choices"][0]["message"]["content"],
            r.json()["choices"][0]["finish_reason"]) == reference(default_llm, [conv])[0]
    assert metric(d.base_url, "kv_transfer_loads_failed_total") == failed + 1
    assert re.search(r"refused the handshake: incompatible KV: connector NixlConnector "
                     r"\(decode\) != TcpConnector \(prefill\)", d.log_tail(20000))
    settle(nixl, leases=False)
    settle(tcp)  # the refused decode side released the prefill side's lease


@pytest.mark.timeout(120)
def test_bad_kv_transfer_params_are_400s(pairs, server) -> None:
    d = pairs["nixl"].decode.base_url
    conv = chats(seed=6, n=1)[0]
    cases = [
        (d, {"kv_transfer_params": {"do_remote_prefill": True}},
         "remote_engine_id is required"),
        (d, {"kv_transfer_params": {"do_remote_decode": True}}, "kv_role is kv_consumer"),
        (d, {"kv_transfer_params": {"do_remote_decode": "yes"}}, "must be bool"),
        (d, {"n": 2, "kv_transfer_params": {"do_remote_decode": True}}, "n=1"),
        (server.base_url, {"kv_transfer_params": {"do_remote_decode": True}},
         "without --kv-transfer-config"),
    ]
    for base, body, msg in cases:
        r = post_chat(base, conv, **body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == "kv_transfer_params" and msg in err["message"], err


@pytest.mark.timeout(300)
def test_prefill_killed_mid_run_every_request_completes(pairs, default_llm) -> None:
    """Last test of the module: it kills the TCP pair's prefill server. Its 5 requests were
    prefilled and not yet read; the decode side cannot reach the prefill side any more and
    recomputes every prompt itself. 5, one more than the decode side's 4 load threads: the
    last load starts after the first ones timed out, while the instance is marked
    unreachable (each prompt is computed three times here: prefill, reference, recompute)."""
    pair = pairs["tcp"]
    d = pair.decode.base_url
    convs = chats(seed=7, n=5)
    want = reference(default_llm, convs)
    params = prefill_all(pair, convs)
    for pid in (pair.prefill.engine_pid, pair.prefill.proc.pid):
        os.kill(pid, signal.SIGKILL)
    pair.prefill.proc.wait(10)
    failed, computed = metric(d, "kv_transfer_loads_failed_total"), local_compute(d)

    async def decode_all() -> list:
        async with AsyncOpenAI(base_url=d + "/v1", api_key="x", timeout=300,
                               max_retries=0) as c:
            return await asyncio.gather(*[
                c.chat.completions.create(model=MODEL, messages=conv, temperature=0,
                                          max_tokens=MAX_TOKENS,
                                          extra_body={"kv_transfer_params": kp})
                for conv, kp in zip(convs, params, strict=True)])

    got = asyncio.run(decode_all())
    for w, r in zip(want, got, strict=True):
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == w
    assert metric(d, "kv_transfer_loads_failed_total") - failed == len(convs)
    assert local_compute(d) - computed == sum(r.usage.prompt_tokens for r in got)
    settle(pair, leases=False)
