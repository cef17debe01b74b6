"""``radixserve bench serve``: an OpenAI-API load generator, like ``vllm bench serve``.

It speaks only the public OpenAI API (``/v1/completions`` or ``/v1/chat/completions``, streamed
as server-sent events), so the same tool measures radixserve, vLLM, SGLang and llama.cpp's server.

Per request it records the time to the first content token (TTFT), the gaps between content
chunks (ITL), the end-to-end latency and the output token count (``usage.completion_tokens``
when the server sends usage, requested with ``stream_options.include_usage``; otherwise the
number of content chunks). TPOT is ``(e2e - TTFT) / (output_tokens - 1)``. Arrivals are a
Poisson process at ``request_rate`` (``inf``: all at once), optionally capped at
``max_concurrency`` requests in flight.

The client is aiohttp, as in vLLM's ``benchmark_serving``: on a small machine the load generator
shares the CPU with the server it measures, and aiohttp spends ~28 us of CPU per streamed chunk
where httpx spent ~85 (64 streams x 128 tokens against radixserve, 2-core Zen 5).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx
import numpy as np

from radixserve.bench.datasets import BenchPrompt
from radixserve.engine_types import SpecDecodeCounts

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
#: per-request limit, seconds: 6 hours, as vLLM's benchmark client (``AIOHTTP_TIMEOUT``). Every
#: request of a level lives for the whole level at c = its request count, and 64 requests of
#: 256 -> 128 tokens at a 1.5B shape on two cores take more than the 600 s this once was
REQUEST_TIMEOUT_S = 6 * 3600.0
#: Latency metrics reported, each as mean/median/p90/p99 in milliseconds.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)
WARMUP_TEXT = "Warm-up request. Please answer with one short greeting."


@dataclass
class RequestResult:
    """One request's measurements; times in seconds."""

    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    cached_tokens: int | None = None
    error: str = ""


def build_payload(p: BenchPrompt, api: str, model: str, ignore_eos: bool, temperature: float,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of one streamed request."""
    body: dict[str, Any] = {"model": model, "max_tokens": p.output_len,
                            "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM / SGLang / radixserve extension
    if api == "chat":
        msgs = []
        if p.system:
            msgs.append({"role": "system", "content": p.system})
        msgs.append({"role": "user", "content": p.text or ""})
        body["messages"] = msgs
    else:
        body["prompt"] = p.prompt_text
    if extra:
        body.update(extra)
    return body


def _content(chunk: dict[str, Any], api: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if api == "chat":
        delta = c.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return c.get("text") or ""


def client_session(timeout_s: float, force_close: bool = False) -> aiohttp.ClientSession:
    """A session for any number of concurrent streams (no connection limit).

    ``force_close``: a new connection for every request, for servers that close a connection
    after each streamed response while announcing keep-alive (llama.cpp's llama-server: aiohttp
    then reuses the closed connection and the request fails with ``ServerDisconnectedError``;
    1 to 7 of 24 requests at c=4, measured). A new loopback connection costs a fraction of a
    millisecond."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 connector=aiohttp.TCPConnector(limit=0,
                                                                force_close=force_close))


async def send_request(client: aiohttp.ClientSession, url: str, body: dict[str, Any], api: str,
                       prompt_len: int) -> RequestResult:
    """Send one streamed request and time its chunks."""
    res = RequestResult(prompt_len=prompt_len)
    chunks = 0
    finish: str | None = None
    first_choice: float | None = None
    usage: dict[str, Any] | None = None
    st = time.perf_counter()
    last = st
    try:
        async with client.post(url, json=body) as r:
            if r.status != 200:
                text = (await r.read()).decode(errors="replace")
                res.error = f"HTTP {r.status}: {text[:300]}"
                return res
            async for raw in r.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    res.error = f"bad SSE data: {data[:200].decode(errors='replace')}"
                    return res
                if "error" in chunk and not chunk.get("choices"):
                    res.error = str(chunk["error"])[:300]
                    return res
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk.get("choices") or ():
                    finish = c.get("finish_reason") or finish
                    first_choice = now if first_choice is None else first_choice
                if _content(chunk, api):
                    if chunks == 0:
                        res.ttft = now - st
                    else:
                        res.itl.append(now - last)
                    chunks += 1
                    last = now
        res.latency = time.perf_counter() - st
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    if chunks == 0 and (finish is None or first_choice is None):
        res.error = "no content in the response"
        return res
    if chunks == 0:
        # a finished stream whose tokens all decode to no text: a random-weight model
        # (``bench make-model``) samples ids beyond its tokenizer's. Its first choice chunk
        # stands for the first token.
        res.ttft = first_choice - st
        chunks = 1
    if finish is None:
        # e.g. llama-cpp-python's server cuts a stream short when another request arrives
        # (unless started with --interrupt_requests False)
        res.error = "the stream ended without a finish_reason (interrupted?)"
        return res
    res.output_tokens = chunks
    if usage:
        res.output_tokens = int(usage.get("completion_tokens") or chunks)
        res.prompt_len = int(usage.get("prompt_tokens") or prompt_len)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            res.cached_tokens = int(details["cached_tokens"])
    res.ok = True
    return res


async def _arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator):
    """Yield request indices at Poisson arrival times (gamma when burstiness != 1)."""
    for i in range(n):
        yield i
        if math.isinf(rate) or i == n - 1:
            continue
        theta = 1.0 / (rate * burstiness)
        await asyncio.sleep(float(rng.gamma(burstiness, theta)))


def _stats(values: list[float], scale: float = 1e3) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, **{f"p{q}": 0.0 for q in PERCENTILES}}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            **{f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES}}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """vLLM-style metrics over a run's request results."""
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    m: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tok / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration > 0 else 0.0,
    }
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    m["cached_prompt_tokens"] = sum(cached) if cached else None
    m["cached_prompt_fraction"] = (sum(cached) / max(in_tok, 1)) if cached else None
    series = {"ttft": [r.ttft for r in ok], "tpot": tpots,
              "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    for name in LATENCY_METRICS:
        for k, v in _stats(series[name]).items():
            m[f"{k}_{name}_ms"] = v
    errors = [r.error for r in results if not r.ok]
    m["errors"] = sorted(set(errors))[:5]
    return m


async def run_async(base_url: str, api: str, model: str, prompts: list[BenchPrompt],
                    request_rate: float = math.inf, max_concurrency: int | None = None,
                    ignore_eos: bool = True, temperature: float = 0.0, seed: int = 0,
                    burstiness: float = 1.0, num_warmups: int = 1, timeout_s: float = REQUEST_TIMEOUT_S,
                    progress: bool = True, extra_body: dict[str, Any] | None = None,
                    force_close: bool = False) -> dict[str, Any]:
    """Run one load level; returns its metrics (see ``summarize``) plus its settings
    (``force_close``: see ``client_session``)."""
    from tqdm.auto import tqdm

    url = base_url.rstrip("/") + ENDPOINTS[api]
    async with client_session(timeout_s, force_close) as client:
        # a fixed warm-up text, so it seeds no prefix cache hit for the measured prompts
        w = BenchPrompt([], 4, WARMUP_TEXT)
        for _ in range(num_warmups):
            r = await send_request(client, url,
                                   build_payload(w, api, model, ignore_eos, temperature,
                                                 extra_body), api, 0)
            if not r.ok:
                raise RuntimeError(f"warm-up request to {url} failed: {r.error}")
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(prompts), disable=not progress, unit="req",
                   desc=f"bench serve c={max_concurrency or '-'} rate={request_rate}")
        rng = np.random.default_rng(seed)

        async def one(p: BenchPrompt) -> RequestResult:
            body = build_payload(p, api, model, ignore_eos, temperature, extra_body)
            if sem is None:
                r = await send_request(client, url, body, api, len(p.token_ids))
            else:
                async with sem:
                    r = await send_request(client, url, body, api, len(p.token_ids))
            bar.update(1)
            return r

        tasks = []
        t0 = time.perf_counter()
        async for i in _arrivals(len(prompts), request_rate, burstiness, rng):
            tasks.append(asyncio.create_task(one(prompts[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    m = summarize(list(results), duration)
    return {"max_concurrency": max_concurrency,
            "request_rate": "inf" if math.isinf(request_rate) else request_rate,
            "num_prompts": len(prompts), **m}


def run(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """``run_async`` from synchronous code."""
    return asyncio.run(run_async(*args, **kwargs))


_SPEC_LINE = re.compile(r"^(?:radixserve|vllm):spec_decode_(num_drafts|num_draft_tokens|"
                        r"num_accepted_tokens|num_accepted_tokens_per_pos)(?:_total)?"
                        r"(?:\{([^}]*)\})?\s+(\S+)$")


def parse_spec_counts(text: str) -> SpecDecodeCounts | None:
    """The cumulative speculative-decoding counters in a Prometheus exposition (a server's
    ``/metrics``: radixserve's ``radixserve:spec_decode_*`` or vLLM's ``vllm:spec_decode_*``
    names), summed over label sets; None when it has none (a server that exports no such
    counters; radixserve's are there, at zero, without speculation)."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _SPEC_LINE.match(line)
        if m is None:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "num_accepted_tokens_per_pos":
            pos = re.search(r'position="(\d+)"', labels)
            if pos is not None:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        else:
            totals[name] = totals.get(name, 0.0) + value
    if "num_drafts" not in totals:
        return None
    return SpecDecodeCounts(
        num_drafts=int(totals["num_drafts"]),
        num_draft_tokens=int(totals.get("num_draft_tokens", 0)),
        num_accepted_tokens=int(totals.get("num_accepted_tokens", 0)),
        accepted_per_pos=[int(per_pos.get(i, 0)) for i in range(max(per_pos, default=-1) + 1)])


def fetch_spec_counts(base_url: str, timeout_s: float = 10.0) -> SpecDecodeCounts | None:
    """``parse_spec_counts`` of the server's ``/metrics``; None when it has no such counters
    or no readable ``/metrics``."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return parse_spec_counts(r.text) if r.status_code == 200 else None


def fetch_model_id(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id the server lists at ``/v1/models``."""
    r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout_s)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(data[0]["id"])


def wait_until_ready(base_url: str, timeout_s: float, proc: Any = None) -> None:
    """Poll ``/v1/models`` until it answers 200 (raises RuntimeError on timeout or when
    ``proc``, a Popen, exits first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(base_url.rstrip("/") + "/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{base_url} not ready after {timeout_s:.0f} s")


def format_table(runs: list[dict[str, Any]]) -> str:
    """One line per load level, like the summary ``vllm bench serve`` prints."""
    head = (f"{'conc':>5}{'rate':>6}{'ok':>5}{'fail':>5}{'dur_s':>8}{'req/s':>8}{'out_tok/s':>11}"
            f"{'tot_tok/s':>11}{'ttft_p50':>10}{'ttft_p99':>10}{'tpot_p50':>10}{'itl_p50':>9}"
            f"{'e2e_p50':>9}")
    lines = [head]
    for r in runs:
        lines.append(
            f"{r['max_concurrency'] or '-':>5}{str(r['request_rate']):>6}{r['completed']:>5}"
            f"{r['failed']:>5}{r['duration']:>8.2f}{r['request_throughput']:>8.2f}"
            f"{r['output_throughput']:>11.1f}{r['total_token_throughput']:>11.1f}"
            f"{r['median_ttft_ms']:>10.1f}{r['p99_ttft_ms']:>10.1f}{r['median_tpot_ms']:>10.1f}"
            f"{r['median_itl_ms']:>9.1f}{r['median_e2el_ms']:>9.1f}")
    return "\n".join(lines)
