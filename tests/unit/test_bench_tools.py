"""Benchmark plumbing without a model: SSE parsing and metrics of ``bench serve`` against a
real HTTP server on 127.0.0.1 (aiohttp's, serving canned streams), and ``bench compare``'s
reporting of missing peers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from radixserve.bench import compare, serve
from radixserve.bench.datasets import BenchPrompt
from radixserve.cache_dir import cache_dir

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + \
        b"data: [DONE]\n\n"


def _stream(chunks: list[dict]) -> Handler:
    """A handler streaming ``chunks`` as SSE events, one write each (as a server does)."""
    async def handler(req: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for part in _sse(chunks).split(b"\n\n")[:-1]:
            await resp.write(part + b"\n\n")
        await resp.write_eof()
        return resp
    return handler


def _run(handler: Handler, api: str = "completions") -> serve.RequestResult:
    async def go() -> serve.RequestResult:
        app = web.Application()
        app.router.add_post(serve.ENDPOINTS[api], handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with serve.client_session(30) as client:
                body = serve.build_payload(BenchPrompt([1, 2, 3], 3, "hi", "sys"), api, "m",
                                           True, 0.0)
                return await serve.send_request(
                    client, f"http://127.0.0.1:{port}" + serve.ENDPOINTS[api], body, api, 3)
        finally:
            await runner.cleanup()
    return asyncio.run(go())


def test_send_request_parses_stream_and_usage() -> None:
    seen = {}
    inner = _stream([
        {"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
        {"choices": [{"text": "c", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                  "prompt_tokens_details": {"cached_tokens": 4}}}])

    async def handler(req: web.Request) -> web.StreamResponse:
        seen.update(await req.json())
        return await inner(req)

    r = _run(handler)
    assert r.ok and r.output_tokens == 3 and r.prompt_len == 7 and r.cached_tokens == 4
    assert len(r.itl) == 2 and r.ttft > 0 and r.latency >= r.ttft
    assert seen["prompt"] == "syshi" and seen["ignore_eos"] is True and seen["stream"] is True
    assert seen["stream_options"] == {"include_usage": True}


def test_send_request_chat_counts_chunks_without_usage() -> None:
    inner = _stream([
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": "x"}}]},
        {"choices": [{"delta": {"content": "y"}, "finish_reason": "stop"}]}])

    async def handler(req: web.Request) -> web.StreamResponse:
        body = await req.json()
        assert body["messages"][0] == {"role": "system", "content": "sys"}
        return await inner(req)

    r = _run(handler, "chat")
    assert r.ok and r.output_tokens == 2 and r.cached_tokens is None


def test_stream_cut_short_is_a_failure() -> None:
    # llama-cpp-python's server ends a stream early when another request interrupts it
    r = _run(_stream([{"choices": [{"text": "a"}]}]))
    assert not r.ok and "finish_reason" in r.error


def test_send_request_http_error_is_a_failure() -> None:
    async def handler(req: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "bad"}}, status=400)

    r = _run(handler)
    assert not r.ok and "HTTP 400" in r.error and "bad" in r.error


def test_send_request_unreachable_server_is_a_failure() -> None:
    async def go() -> serve.RequestResult:
        async with serve.client_session(5) as client:
            return await serve.send_request(client, "http://127.0.0.1:9/v1/completions", {},
                                            "completions", 0)
    r = asyncio.run(go())
    assert not r.ok and "Error" in r.error


def test_summarize_keys_and_tpot() -> None:
    rs = [serve.RequestResult(ok=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5,
                              itl=[0.1] * 4),
          serve.RequestResult(ok=False, error="boom")]
    m = serve.summarize(rs, 1.0)
    assert m["completed"] == 1 and m["failed"] == 1 and m["errors"] == ["boom"]
    assert abs(m["mean_tpot_ms"] - 100.0) < 1e-6
    assert m["output_throughput"] == 5.0 and m["total_token_throughput"] == 15.0
    assert m["cached_prompt_tokens"] is None


def test_compare_reports_missing_peers(tmp_path: Path) -> None:
    st = compare.peer_status(str(tmp_path / "no-venv"), ("llama.cpp", "vllm"))
    for name in ("llama.cpp", "vllm"):
        assert st[name]["available"] is False and "make bench-peers" in st[name]["reason"]
    doc = {"offline": {"radixserve": {"output_tokens_per_s": 100.0, "total_tokens_per_s": 150.0},
                       "transformers": {"output_tokens_per_s": 50.0,
                                        "total_tokens_per_s": 75.0},
                       "vllm": {"status": "unavailable", "reason": st["vllm"]["reason"]}},
           "serve": {"radixserve": {"runs": [{"max_concurrency": 1, "output_throughput": 40.0,
                                              "median_ttft_ms": 1.0, "median_tpot_ms": 2.0,
                                              "failed": 0}]},
                     "llama.cpp": {"status": "unavailable", "reason": "not installed"}}}
    doc["ratios"] = compare.ratios(doc)
    assert doc["ratios"]["offline"] == {"transformers": 2.0}
    table = compare.format_table(doc)
    assert "vllm" in table and "unavailable" in table and "llama.cpp" in table


def test_cpu_kind_names_the_kinds_of_the_figures() -> None:
    """Every figure's JSON says which CPU kind it came from: the kind follows the flags that
    pick the dtype and kernels, and the record agrees with this machine's /proc/cpuinfo."""
    from radixserve.bench.overhead import KIND_FLAGS, cpu_kind, machine_info

    base = {"sse4_2", "avx", "avx2", "fma", "f16c"}
    assert cpu_kind(base) == "avx2"
    assert cpu_kind(base - {"fma"}) == "other"
    ice_lake = base | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_vbmi2"}
    assert cpu_kind(ice_lake) == "avx512"
    assert cpu_kind(ice_lake | {"avx512_bf16"}) == "avx512-bf16"
    assert cpu_kind(ice_lake | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}) == "amx"
    info = machine_info()
    flags = next(set(ln.split(":", 1)[1].split())
                 for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("flags"))
    assert info["cpu_kind"] == cpu_kind(flags)
    assert info["cpu_flags"] == [f for f in KIND_FLAGS if f in flags]
    table = compare.format_table({"machine": info, "offline": {}, "serve": {}})
    assert table.splitlines()[0].startswith(f"machine: {info['cpu']} (CPU kind "
                                            f"{info['cpu_kind']})")


def test_avx2_emulation_holds_every_layer_to_avx2() -> None:
    """``benchmarks/avx2_emulation/run.sh`` (figures labelled "held to AVX2" rest on it): the
    C kernels are the haswell build, torch, oneDNN and Inductor see no AVX-512, and
    /proc/cpuinfo lists none either, so ``--dtype auto`` is float32 as on the AVX2 kind."""
    root = Path(__file__).resolve().parents[2]
    probe = ("import json, os, torch\n"
             "from torch._inductor.cpu_vec_isa import pick_vec_isa\n"
             "from radixserve.model_executor.kernels.cpu import CpuKernels\n"
             "from radixserve.model_executor.device_policy import resolve_dtype\n"
             "k = CpuKernels.load()\n"
             "flags = [ln for ln in open('/proc/cpuinfo') if ln.startswith('flags')][0]\n"
             "print(json.dumps({'f32': k.f32_gemm_isa, 'bf16_dot': k.has_bf16_dot,\n"
             "  'avx512': torch.cpu._is_avx512_supported(),\n"
             "  'aten': torch.backends.cpu.get_cpu_capability(), 'inductor': str(pick_vec_isa()),\n"
             "  'onednn': os.environ['ONEDNN_MAX_CPU_ISA'], 'avx512_flags': 'avx512' in flags,\n"
             "  'auto': str(resolve_dtype('auto', torch.device('cpu')))}))")
    # the test session's cache root, not the emulation's own folder under $HOME
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["RADIXSERVE_CACHE_DIR"] = str(cache_dir("kernels").parent)
    out = subprocess.run(["bash", str(root / "benchmarks/avx2_emulation/run.sh"), sys.executable,
                          "-c", probe], env=env, capture_output=True, text=True, timeout=300,
                         check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {"f32": "avx2", "bf16_dot": False, "avx512": False, "aten": "AVX2",
                   "inductor": "avx2", "onednn": "AVX2", "avx512_flags": False,
                   "auto": "torch.float32"}


def test_server_peak_rss_sums_its_process_tree():
    """``bench compare``'s peak RSS of a server: it and every process under it (radixserve's
    engine process runs in a session of its own), read before they exit."""
    import subprocess
    import sys
    import time

    from radixserve.bench.compare import process_tree_peak_rss

    code = ("import subprocess, sys, time\n"
            "b = bytearray(96 << 20)\n"
            "c = subprocess.Popen([sys.executable, '-c', "
            "'b = bytearray(64 << 20); import time; time.sleep(60)'], "
            "start_new_session=True)\n"
            "print('up', flush=True); time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "up"
        time.sleep(1.0)  # the child has touched its 64 MiB
        peak = process_tree_peak_rss(p.pid)
        assert peak is not None and peak >= (96 + 64) << 20
        assert process_tree_peak_rss(999_999_999) is None
    finally:
        import os
        import signal

        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_decode_floor():
    from radixserve.bench.bandwidth import decode_floor_ms, measure_read_bandwidth

    assert decode_floor_ms(15_000_000_000, 30.0) == pytest.approx(500.0)
    bw = measure_read_bandwidth(buffer_bytes=64 << 20, runs=2, threads=1)
    assert bw.gb_per_s > 0.1 and len(bw.runs_gb_per_s) == 2
    # the streaming reader runs where the C kernels build (every x86 kind) and is a reader
    assert len(bw.stream_runs_gb_per_s) == 2
    assert bw.gb_per_s == pytest.approx(max(bw.runs_gb_per_s + bw.stream_runs_gb_per_s),
                                        abs=0.01)
    with pytest.raises(ValueError):
        measure_read_bandwidth(buffer_bytes=1 << 20)


def test_stream_read_reads_every_value():
    import torch

    from radixserve.model_executor.kernels.cpu import CpuKernels

    k = CpuKernels.load()
    assert k is not None
    # sizes with tails past the 32-wide loop and past the four streams of each thread's share
    for n in (7, 32 * 8, 1000 * 33 + 7, 32 * 4099 + 5):
        x = (torch.arange(n, dtype=torch.float32) % 7) + 1
        assert k.stream_read(x) == pytest.approx(float(x.double().sum()), rel=1e-6), n
    with pytest.raises(ValueError):
        k.stream_read(x.double())


def test_bench_quant_kernels_cli(tmp_path, capsys):
    """``radixserve bench quant-kernels`` times each type at each M and writes the rows."""
    import json

    from radixserve.cli import main

    out = tmp_path / "q.json"
    assert main(["bench", "quant-kernels", "--n", "64", "--k", "256", "--m", "1,3",
                 "--types", "Q4_0,Q6_K", "--min-time", "0.01", "--no-yardsticks",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    got = {(r["kernel"], r["m"]) for r in doc["rows"]}
    assert got == {("Q4_0", 1), ("Q4_0", 3), ("Q6_K", 1), ("Q6_K", 3)}
    assert all(r["us"] > 0 and r["gb_s"] > 0 for r in doc["rows"])
    assert "GB/s of weight bytes" in capsys.readouterr().out


def test_decode_bytes_count_what_a_step_reads(tmp_path):
    """The floor's bytes: an untied embedding table is looked up, not read; int8 reads one
    byte per projection and head value plus its scales; a bf16 checkpoint under float32 its
    bf16."""
    import torch
    from tests.integration.tiny_models import tiny_model
    from transformers import AutoConfig

    from radixserve.bench.compare import decode_bytes
    from radixserve.model_executor.memory_fit import weight_bytes
    from radixserve.model_executor.models.llama import ModelArgs

    llama = tiny_model(tmp_path / "f32", "llama")  # untied, float32 safetensors
    qwen = tiny_model(tmp_path / "bf16", "qwen2", save_dtype=torch.bfloat16)  # tied
    a = ModelArgs.from_hf(AutoConfig.from_pretrained(llama))
    table = a.vocab_size * a.hidden_size
    got, held = decode_bytes(a, Path(llama), "float32", None, None)
    assert (got, held) == (weight_bytes(a, torch.float32) - 4 * table, "float32")
    got, held = decode_bytes(a, Path(llama), "float32", "int8", None)
    per_layer_outputs = a.num_heads * a.head_dim + 2 * a.num_kv_heads * a.head_dim \
        + 2 * a.hidden_size + 2 * a.intermediate_size
    assert got == (weight_bytes(a, torch.int8) - table
                   + 4 * (a.num_layers * per_layer_outputs + a.vocab_size))
    assert held == "int8 weights, dense float32 embedding"
    q = ModelArgs.from_hf(AutoConfig.from_pretrained(qwen))
    got, held = decode_bytes(q, Path(qwen), "float32", None, None)
    assert got == weight_bytes(q, torch.bfloat16)
    assert held == "bfloat16 weights, float32 activations"
