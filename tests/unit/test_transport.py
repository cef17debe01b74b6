"""Frontend <-> engine-core transport over real ZMQ IPC sockets (and the metrics fed by it)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from radixserve import engine_types as et
from radixserve.metrics import ServerMetrics
from radixserve.sampling_params import SamplingParams
from radixserve.transport import messages
from radixserve.transport.messages import (
    SCHEMA_VERSION,
    AbortRequests,
    EngineError,
    FlushCache,
    FlushCacheDone,
    Hello,
    Shutdown,
    decoder,
    encoder,
)
from radixserve.transport.zmq_io import (
    AsyncClientSockets,
    CoreSockets,
    cleanup_ipc,
    make_ipc_paths,
)

encode = encoder().encode


def ids(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def plain(msgs: list) -> list:
    """Messages as builtins (arrays as lists) with their types: structs holding numpy arrays
    have no truthful ``==``."""
    return [(type(m).__name__, msgspec.to_builtins(m, enc_hook=lambda a: a.tolist()))
            for m in msgs]

INFO = et.EngineInfo(model_name="SmolLM2", folder="/m", max_model_len=8192, vocab_size=49152,
                     eos_token_ids=[2, 0], dtype="float32", device="cpu", num_pages=640,
                     page_size=16, pid=4242)

CLIENT_MESSAGES = [
    et.EngineRequest(
        request_id="r1",
        prompt_token_ids=ids([1, 2, 3, 49151]),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=8, stop=["\n"], seed=7),
        arrival_time=123.5,
        eos_token_ids=[9],
    ),
    et.EngineRequest(request_id="r2", prompt_token_ids=ids([]),
                     sampling_params=SamplingParams(seed=-2**63, max_tokens=None)),
    AbortRequests(request_ids=["r1", "r2"]),
    Hello(schema_version=SCHEMA_VERSION),
    Shutdown(),
    FlushCache(call_id=3),
]

STATS = et.SchedulerStats(num_running=3, num_waiting=1, kv_pages_used=5, kv_pages_total=20,
                       prefix_queried_tokens=100, prefix_hit_tokens=40, num_preemptions=1,
                       prompt_tokens=100, generation_tokens=7,
                       step_timings={"schedule": [1e-4, 2e-4], "forward": [0.01]})

CORE_MESSAGES = [
    et.StepOutputs(
        step=4,
        outputs=[
            et.TokenOutput(request_id="r1", new_token_ids=[42],
                           logprobs=[[[42.0, -0.5], [7.0, -1.5]]], num_prompt_tokens=4,
                           num_cached_tokens=2),
            et.TokenOutput(request_id="r2", new_token_ids=[2], finish_reason="stop",
                           stop_reason=2, queue_time=0.25),
            et.TokenOutput(request_id="r3", finish_reason="abort", error="too long",
                           error_param="prompt", error_code="context_length_exceeded"),
        ],
        stats=STATS,
    ),
    et.StepOutputs(step=5, outputs=[]),
    # column-wise decodes next to a full output
    et.StepOutputs(step=6, outputs=[et.TokenOutput(request_id="r4", new_token_ids=[9],
                                                   num_prompt_tokens=3)],
                   decode_request_ids=["r5", "r6"], decode_token_ids=ids([11, 49151])),
    Hello(schema_version=SCHEMA_VERSION, info=INFO),
    EngineError(message="boom"),
    FlushCacheDone(call_id=3, pages_freed=12),
]


@pytest.fixture
def addrs():
    a = make_ipc_paths()
    yield a
    cleanup_ipc(*a)


def test_make_ipc_paths_private_and_cleaned(tmp_path):
    inp, out = make_ipc_paths()
    d = Path(inp[len("ipc://"):]).parent
    assert inp.startswith("ipc://") and out.startswith("ipc://") and inp != out
    assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700
    cleanup_ipc(inp, out)
    assert not d.exists()
    inp, out = make_ipc_paths(tmp_path / "run")
    assert Path(inp[len("ipc://"):]).parent == tmp_path / "run"
    with pytest.raises(ValueError, match="too long"):
        make_ipc_paths(tmp_path / ("x" * 120))


def test_round_trip_every_message(addrs):
    async def main():
        core = CoreSockets(*addrs)
        client = AsyncClientSockets(*addrs)
        try:
            core_hs = asyncio.create_task(asyncio.to_thread(core.handshake, 10.0, INFO))
            hello = await client.handshake(10.0)
            assert hello.info == INFO and isinstance(hello.info, et.EngineInfo)
            assert (await core_hs).schema_version == SCHEMA_VERSION
            assert all(Path(a[len("ipc://"):]).exists() for a in addrs)

            for msg in CLIENT_MESSAGES:
                await client.send(msg)
            got = [await asyncio.to_thread(core.recv, 5000) for _ in CLIENT_MESSAGES]
            assert plain(got) == plain(CLIENT_MESSAGES)
            # prompts arrive as int32 arrays over the message's bytes
            assert got[0].prompt_token_ids.dtype == np.dtype("<i4")
            assert core.recv(timeout_ms=0) is None and core.recv_nowait() == []

            await client.send(Shutdown())
            await client.send_encoded(encode(AbortRequests(["x"])))
            await asyncio.sleep(0.05)
            assert core.recv_nowait() == [Shutdown(), AbortRequests(["x"])]

            for msg in CORE_MESSAGES:
                core.send(msg)
            got = [await asyncio.wait_for(client.recv(), 5) for _ in CORE_MESSAGES]
            assert plain(got) == plain(CORE_MESSAGES)
            assert got[2].decode_token_ids.dtype == np.dtype("<i4")
        finally:
            client.close()
            core.close()

    asyncio.run(main())


def test_int32_ids_travel_as_raw_bytes(addrs):
    values = np.array([0, 1, 2, 151_935, 2**31 - 1, 7], dtype=np.int64)
    req = et.EngineRequest(request_id="ids", prompt_token_ids=values,
                           sampling_params=SamplingParams())
    buf = encode(req)
    assert values.astype("<i4").tobytes() in buf  # one bin field, not per-token integers
    big = np.arange(100_000) % 50_000  # large message (zero-copy send path)

    async def main():
        core = CoreSockets(*addrs)
        client = AsyncClientSockets(*addrs)
        try:
            await client.send(req)
            got = await asyncio.to_thread(core.recv, 5000)
            arr = got.prompt_token_ids
            assert arr.dtype == np.dtype("<i4") and arr.tolist() == values.tolist()
            core.send(et.StepOutputs(step=0, decode_request_ids=[f"r{i}" for i in range(len(big))],
                                     decode_token_ids=big.astype(np.int32)))
            out = await asyncio.wait_for(client.recv(), 5)
            assert np.array_equal(out.decode_token_ids, big)
        finally:
            client.close()
            core.close()

    asyncio.run(main())


def test_engine_structs_are_the_wire_structs():
    er = et.EngineRequest(request_id="a", prompt_token_ids=np.array([5, 0, 49151], np.int32),
                          sampling_params=SamplingParams(seed=3), arrival_time=7.5,
                          eos_token_ids=[9])
    back = decoder(messages.ClientMessage).decode(encode(er))
    assert isinstance(back, et.EngineRequest)
    assert back.request_id == "a" and back.arrival_time == 7.5 and back.eos_token_ids == [9]
    assert back.sampling_params == er.sampling_params
    assert back.prompt_token_ids.dtype == np.int32
    assert back.prompt_token_ids.tolist() == [5, 0, 49151]
    # no second copy of the concepts on the wire
    assert not any(n.startswith("Wire") for n in dir(messages))
    assert not hasattr(messages, "RequestOutput")  # the public one is radixserve.outputs'


def test_step_outputs_keep_columns_and_rejections():
    step = et.StepOutputs(
        step=7,
        outputs=[et.TokenOutput(request_id="a", new_token_ids=[5], finish_reason="length",
                                num_prompt_tokens=2, num_cached_tokens=1, queue_time=0.5,
                                logprobs=[[[5.0, -0.1], [6.0, -2.0]]]),
                 et.TokenOutput(request_id="z", finish_reason="abort", error="too long",
                                error_param="prompt", error_code="context_length_exceeded")],
        decode_request_ids=["b", "c", "d"],
        decode_token_ids=np.array([0, 2**31 - 1, 1000], dtype=np.int32), stats=STATS)
    got = decoder(messages.CoreMessage).decode(encode(step))
    assert got.step == 7 and got.num_outputs == 5 and got.stats == STATS
    assert got.outputs == step.outputs  # full outputs: every field, error_param/code included
    # the decode column stays one int32 array: no per-token structs on the frontend side
    assert got.decode_request_ids == ["b", "c", "d"]
    assert got.decode_token_ids.dtype == np.int32
    assert got.decode_token_ids.tolist() == [0, 2**31 - 1, 1000]
    empty = decoder(messages.CoreMessage).decode(encode(et.StepOutputs(step=1)))
    assert empty.num_outputs == 0 and empty.decode_token_ids.shape == (0,)


def test_a_non_array_id_field_is_refused_on_decode():
    bad = msgspec.msgpack.encode(["req", "a", [1, 2], SamplingParams(), 0.0, None, None])
    with pytest.raises(msgspec.ValidationError):
        decoder(messages.ClientMessage).decode(bad)


def _raw(kind: int, addr: str, bind: bool, ctx: zmq.Context) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(addr) if bind else s.connect(addr)
    return s


def test_core_refuses_schema_mismatch(addrs):
    core = CoreSockets(*addrs)
    ctx = zmq.Context()
    push, pull = _raw(zmq.PUSH, addrs[0], False, ctx), _raw(zmq.PULL, addrs[1], False, ctx)
    try:
        push.send(encode(Hello(schema_version=SCHEMA_VERSION + 1)))
        with pytest.raises(RuntimeError, match="schema"):
            core.handshake(5.0)
        # The core still answered with its own Hello, so the peer can report the mismatch too.
        assert pull.poll(5000)
        assert msgspec.msgpack.decode(pull.recv())[:2] == ["hello", SCHEMA_VERSION]
        # A Hello from a future schema whose layout we cannot decode is refused just as clearly.
        push.send(msgspec.msgpack.encode(["hello", 99, {}, "new field"]))
        with pytest.raises(RuntimeError, match="schema_version=99"):
            core.handshake(5.0)
        push.send(encode(Shutdown()))
        with pytest.raises(RuntimeError, match="before Hello"):
            core.handshake(5.0)
        with pytest.raises(RuntimeError, match="no Hello"):
            core.handshake(0.05)
    finally:
        push.close(), pull.close(), ctx.term()
        core.close()


def test_client_refuses_schema_mismatch_and_reports_engine_error(addrs):
    async def main():
        ctx = zmq.Context()
        pull, push = _raw(zmq.PULL, addrs[0], True, ctx), _raw(zmq.PUSH, addrs[1], True, ctx)
        client = AsyncClientSockets(*addrs)
        try:
            push.send(encode(Hello(schema_version=SCHEMA_VERSION + 1)))
            with pytest.raises(RuntimeError, match="schema"):
                await client.handshake(5.0)
            push.send(encode(EngineError("CUDA out of memory")))
            with pytest.raises(RuntimeError, match="CUDA out of memory"):
                await client.handshake(5.0)
            with pytest.raises(RuntimeError, match="no Hello"):
                await client.handshake(0.05)
        finally:
            client.close()
            pull.close(), push.close(), ctx.term()

    asyncio.run(main())


def test_no_pickle_on_the_wire():
    import radixserve.transport.zmq_io as zmq_io

    src = Path(zmq_io.__file__).read_text()
    assert "pickle" not in src.replace("no pickle", "")
    assert "send_pyobj" not in src and "recv_pyobj" not in src


def test_stats_reach_metrics():
    m = ServerMetrics(model_name="smol")
    m.update_from_stats(STATS)
    later = msgspec.structs.replace(STATS, prompt_tokens=130, generation_tokens=9,
                                    num_running=1, step_timings={})
    m.update_from_stats(later)
    m.observe_request("stop", e2e_latency=1.0, ttft=0.2, num_output_tokens=5, queue_time=0.01)
    m.observe_request("length", e2e_latency=2.0)
    text, content_type = m.render()
    text = text.decode()
    assert content_type.startswith("text/plain")

    def value(line_start: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(line_start))
        return float(line.rsplit(" ", 1)[1])

    lbl = '{model_name="smol"}'
    assert value(f"radixserve:num_requests_running{lbl}") == 1
    assert value(f"radixserve:kv_cache_usage_perc{lbl}") == 0.25
    assert value(f"radixserve:prompt_tokens_total{lbl}") == 130  # deltas, not re-added totals
    assert value(f"radixserve:generation_tokens_total{lbl}") == 9
    assert value(f"radixserve:prefix_cache_hits_total{lbl}") == 40
    assert value(f"radixserve:num_preemptions_total{lbl}") == 1
    assert value('radixserve:request_success_total{finished_reason="stop",model_name="smol"}') == 1
    assert value(f"radixserve:step_schedule_seconds_count{lbl}") == 2
    assert value(f"radixserve:time_per_output_token_seconds_sum{lbl}") == pytest.approx(0.2)
    assert value(f"radixserve:e2e_request_latency_seconds_count{lbl}") == 2
    # pages only the radix cache holds are free, as vLLM's cached free blocks
    warm = msgspec.structs.replace(later, kv_pages_used=15, kv_pages_evictable=12,
                                   kv_pages_cached=14)
    m.update_from_stats(warm)
    text = m.render()[0].decode()
    assert value(f"radixserve:kv_cache_usage_perc{lbl}") == pytest.approx(3 / 20)
    assert value(f"radixserve:kv_cache_pages_used{lbl}") == 15
    # Separate instances never share a registry.
    assert b"smol" not in ServerMetrics().render()[0]
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") is None
