"""Frontend <-> engine-core transport over real ZMQ IPC sockets (and the metrics fed by it)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from radixserve.metrics import ServerMetrics
from radixserve.sampling_params import SamplingParams
from radixserve.transport.messages import (
    SCHEMA_VERSION,
    AbortRequests,
    EngineError,
    EngineOutputs,
    EngineRequest,
    Hello,
    RequestOutput,
    SchedulerStats,
    Shutdown,
    StatsRequest,
    pack_ids,
    unpack_ids,
)
from radixserve.transport.zmq_io import (
    AsyncClientSockets,
    CoreSockets,
    Encoder,
    cleanup_ipc,
    make_ipc_paths,
)

CLIENT_MESSAGES = [
    EngineRequest(
        request_id="r1",
        prompt_token_ids=pack_ids([1, 2, 3, 49151]),
        sampling_params=SamplingParams(temperature=0.0, max_tokens=8, stop=["\n"], seed=7),
        eos_token_ids=[2],
        arrival_time=123.5,
    ),
    EngineRequest("r2", pack_ids([]), SamplingParams(), [], 0.0),
    AbortRequests(request_ids=["r1", "r2"]),
    Hello(schema_version=SCHEMA_VERSION, info={"pid": 1, "name": "x", "t": 1.5}),
    StatsRequest(),
    Shutdown(),
]

STATS = SchedulerStats(num_running=3, num_waiting=1, kv_pages_used=5, kv_pages_total=20,
                       prefix_queried_tokens=100, prefix_hit_tokens=40, num_preemptions=1,
                       prompt_tokens=100, generation_tokens=7,
                       step_timings={"schedule": [1e-4, 2e-4], "forward": [0.01]})

CORE_MESSAGES = [
    EngineOutputs(
        step=4,
        outputs=[
            RequestOutput("r1", pack_ids([42]), logprobs=[[[42.0, -0.5], [7.0, -1.5]]],
                          num_prompt_tokens=4, num_cached_tokens=2),
            RequestOutput("r2", pack_ids([2]), finish_reason="stop", stop_reason=2),
            RequestOutput("r3", pack_ids([]), finish_reason="abort", error="too long"),
        ],
        timestamp=1.25,
        stats=STATS,
    ),
    EngineOutputs(step=5, outputs=[], timestamp=2.0),
    # column-wise decodes next to a full output
    EngineOutputs(step=6, outputs=[RequestOutput("r4", pack_ids([9]), num_prompt_tokens=3)],
                  timestamp=3.0, decode_request_ids=["r5", "r6"],
                  decode_token_ids=pack_ids([11, 49151])),
    Hello(schema_version=SCHEMA_VERSION),
    EngineError(message="boom"),
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
            core_hs = asyncio.create_task(asyncio.to_thread(core.handshake, 10.0, {"role": "core"}))
            hello = await client.handshake(10.0)
            assert hello.info == {"role": "core"}
            assert (await core_hs).schema_version == SCHEMA_VERSION
            assert all(Path(a[len("ipc://"):]).exists() for a in addrs)

            for msg in CLIENT_MESSAGES:
                await client.send(msg)
            got = [await asyncio.to_thread(core.recv, 5000) for _ in CLIENT_MESSAGES]
            assert got == CLIENT_MESSAGES
            assert core.recv(timeout_ms=0) is None and core.recv_nowait() == []

            await client.send(Shutdown())
            await client.send(StatsRequest())
            await asyncio.sleep(0.05)
            assert core.recv_nowait() == [Shutdown(), StatsRequest()]

            for msg in CORE_MESSAGES:
                core.send(msg)
            got = [await asyncio.wait_for(client.recv(), 5) for _ in CORE_MESSAGES]
            assert got == CORE_MESSAGES
        finally:
            client.close()
            core.close()

    asyncio.run(main())


def test_int32_ids_bytes_round_trip(addrs):
    ids = np.array([0, 1, 2, 151_935, 2**31 - 1, 7], dtype=np.int64)
    req = EngineRequest("ids", pack_ids(ids), SamplingParams(), [0], 0.0)
    assert len(req.prompt_token_ids) == 4 * len(ids)
    assert req.prompt_token_ids == ids.astype("<i4").tobytes()
    big = np.arange(100_000) % 50_000  # large message (zero-copy send path)

    async def main():
        core = CoreSockets(*addrs)
        client = AsyncClientSockets(*addrs)
        try:
            await client.send(req)
            got = await asyncio.to_thread(core.recv, 5000)
            arr = unpack_ids(got.prompt_token_ids)
            assert arr.dtype == np.dtype("<i4") and arr.tolist() == ids.tolist()
            core.send(EngineOutputs(0, [RequestOutput("ids", pack_ids(big))], 0.0))
            out = await asyncio.wait_for(client.recv(), 5)
            assert np.array_equal(unpack_ids(out.outputs[0].new_token_ids), big)
        finally:
            client.close()
            core.close()

    asyncio.run(main())


def test_column_wise_decodes_expand_to_outputs():
    msg = EngineOutputs(7, [RequestOutput("a", pack_ids([5]), finish_reason="length",
                                          num_prompt_tokens=2, num_cached_tokens=1)], 0.0,
                        decode_request_ids=["b", "c", "d"],
                        decode_token_ids=np.array([0, 2**31 - 1, 1000]).astype("<i4").tobytes())
    assert msg.num_outputs == 4
    outs = msg.all_outputs()
    assert [o.request_id for o in outs] == ["a", "b", "c", "d"]
    assert outs[0] is msg.outputs[0]
    assert [unpack_ids(o.new_token_ids).tolist() for o in outs[1:]] == [[0], [2**31 - 1], [1000]]
    # a column-wise decode carries nothing else (the consumer keeps its prompt info)
    assert all(o.finish_reason is None and o.logprobs is None and o.num_prompt_tokens == 0
               and o.num_cached_tokens == 0 and o.queue_time is None for o in outs[1:])
    assert EngineOutputs(1, [], 0.0).all_outputs() == []


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
        push.send(Encoder().encode(Hello(schema_version=SCHEMA_VERSION + 1)))
        with pytest.raises(RuntimeError, match="schema"):
            core.handshake(5.0)
        # The core still answered with its own Hello, so the peer can report the mismatch too.
        assert pull.poll(5000)
        assert msgspec.msgpack.decode(pull.recv())[:2] == ["hello", SCHEMA_VERSION]
        # A Hello from a future schema whose layout we cannot decode is refused just as clearly.
        push.send(msgspec.msgpack.encode(["hello", 99, {}, "new field"]))
        with pytest.raises(RuntimeError, match="schema_version=99"):
            core.handshake(5.0)
        push.send(Encoder().encode(Shutdown()))
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
            push.send(Encoder().encode(Hello(schema_version=SCHEMA_VERSION + 1)))
            with pytest.raises(RuntimeError, match="schema"):
                await client.handshake(5.0)
            push.send(Encoder().encode(EngineError("CUDA out of memory")))
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
    # Separate instances never share a registry.
    assert b"smol" not in ServerMetrics().render()[0]
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") is None
