"""AsyncEngineClient against the real engine-core loop (``EngineLoop`` over an ``EngineCore``
with the null runner, no weights) in a thread of the test process, over real ZMQ IPC sockets:
deltas reach their streams, stop strings abort in the engine, rejections keep their field, and
a request that cannot be encoded fails alone while the link keeps serving."""

from __future__ import annotations

import asyncio
import os
import threading

import msgspec
import numpy as np
import pytest

from radixserve.config import EngineConfig
from radixserve.engine_types import EngineRequest
from radixserve.frontend.async_client import (
    AsyncEngineClient,
    EngineDeadError,
    RequestEncodeError,
)
from radixserve.frontend.engine_process import EngineProcess
from radixserve.sampling_params import SamplingParams
from radixserve.transport.zmq_io import CoreSockets, cleanup_ipc, make_ipc_paths

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MAX_MODEL_LEN = 64


class InThreadEngine(EngineProcess):
    """``EngineProcess`` whose "process" is the engine-core loop in a thread: the client's
    supervision hooks (start, exited, alive, terminate, wait, cleanup) without a model load."""

    def __init__(self, step_s: float = 0.0) -> None:
        super().__init__(EngineConfig())
        self.step_s = step_s  # seconds each null step takes
        self.thread: threading.Thread | None = None
        self.loop = None
        self.token_id = 0

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    @property
    def returncode(self) -> int | None:
        return None if self.alive else 0

    def start(self, on_exit):  # noqa: ANN001, ANN201 - EngineProcess.start's signature
        from radixserve.core.engine_core import EngineCore
        from radixserve.core.engine_proc import EngineLoop
        from radixserve.model_executor.null_runner import NullRunner

        aio = asyncio.get_running_loop()
        # built here, not in the thread: a construction error fails the test at once instead
        # of leaving the client waiting for a Hello that never comes
        runner = NullRunner(num_pages=16, max_model_len=MAX_MODEL_LEN, vocab_size=49152,
                            step_s=self.step_s)
        self.token_id = runner.token_id
        engine = EngineCore(EngineConfig(page_size=16, num_pages=16, max_num_seqs=8,
                                         disable_overlap=True), runner)
        self.addrs = make_ipc_paths()
        sockets = CoreSockets(*self.addrs)
        self.loop = EngineLoop(engine, sockets, parent_pid=None)

        def run() -> None:
            try:
                sockets.handshake(10.0, info=msgspec.structs.replace(engine.info, pid=1))
                self.loop.run()
            finally:
                engine.shutdown()
                sockets.close()

                def exited() -> None:
                    self.exited.set()
                    on_exit(0)

                aio.call_soon_threadsafe(exited)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return self.addrs

    def terminate(self) -> None:
        if self.loop is not None:
            self.loop.request_stop("terminated")

    async def wait(self, timeout_s: float) -> None:
        if self.thread is not None:
            await asyncio.to_thread(self.thread.join, timeout_s)

    def cleanup(self) -> None:
        cleanup_ipc(*self.addrs)


def _req(rid: str, prompt: list[int], sp: SamplingParams) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=np.asarray(prompt, dtype=np.int32),
                         sampling_params=sp, arrival_time=1.0)


async def _collect(stream) -> list:  # noqa: ANN001
    deltas = []
    while not stream.finished:
        deltas += await asyncio.wait_for(stream.next_batch(), 10)
    stream.close()
    return deltas


def test_client_routes_deltas_and_isolates_bad_requests(tok) -> None:
    async def main() -> None:
        fatal: list[str] = []
        client = AsyncEngineClient(EngineConfig(), start_timeout_s=30, on_fatal=fatal.append)
        engine = InThreadEngine()
        client.process = engine
        info = await client.start()
        assert info.max_model_len == MAX_MODEL_LEN and info.pid == 1 and client.healthy
        client.set_tokenizer(tok)
        word = tok.decode([engine.token_id])
        try:
            # two choices of one API request, one of them ended by a stop string
            stream = client.add_requests([
                _req("a-0", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)),
                _req("a-1", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True,
                                                      stop=[word * 2]))])
            deltas = await _collect(stream)
            a0, a1 = stream.states
            assert (a0.index, a1.index) == (0, 1)
            assert a0.finish_reason == "length" and a0.num_tokens == 5
            assert "".join(d.text for d in deltas if d.request_id == "a-0") == word * 5
            assert a1.finish_reason == "stop" and a1.stop_reason == word * 2 and a1.text == ""
            assert a0.first_token_time is not None and a0.num_prompt_tokens == 3

            # the engine's rejection comes back on the request, naming the field
            (d,) = await _collect(client.add_requests([
                _req("long", [1] * MAX_MODEL_LEN, SamplingParams(max_tokens=None))]))
            assert d.finish_reason == "abort" and d.error_param == "prompt"
            assert d.error_code == "context_length_exceeded" and str(MAX_MODEL_LEN) in d.error

            # a request that cannot be put on the wire fails alone, before anything is sent
            bad = SamplingParams(seed=1)
            bad.seed = -2**63 - 1  # past __post_init__'s check: the sender's last line
            with pytest.raises(RequestEncodeError, match="cannot be sent"):
                client.add_requests([_req("ok-first", [1, 2], SamplingParams(max_tokens=2)),
                                     _req("bad", [1, 2], bad)])
            # text UTF-8 cannot write (a lone surrogate; the API refuses it before this): the
            # same error, not the ValueError of a request id already in flight
            with pytest.raises(RequestEncodeError, match="cannot be sent"):
                client.add_requests([_req("bad-text", [1, 2],
                                          SamplingParams(max_tokens=2, stop=["\ud800"]))])
            assert client.num_in_flight == 0 and client.healthy
            ok = await _collect(client.add_requests([
                _req("after", [4, 5], SamplingParams(max_tokens=3, ignore_eos=True))]))
            assert ok[-1].finish_reason == "length" and ok[-1].state.num_tokens == 3
            assert not fatal and client.dead_reason is None
            # the engine holds nothing: the stop-string abort reached it
            assert not engine.loop.engine.has_unfinished_requests()
        finally:
            await client.shutdown(5.0)
        assert not engine.alive and not fatal

    asyncio.run(main())


def test_flush_cache_and_out_of_band_cancel(tok) -> None:
    """``flush_cache`` travels to the core and back with the pages it freed (a live request's
    locked prefix stays); ``RequestStream.cancel`` aborts in the engine and wakes the
    consumer with the given exception."""
    async def main() -> None:
        client = AsyncEngineClient(EngineConfig(), start_timeout_s=30)
        engine = InThreadEngine(step_s=0.05)  # the live request lasts ~0.7 s
        client.process = engine
        await client.start()
        client.set_tokenizer(tok)
        core = engine.loop.engine
        try:
            prompt = list(range(1, 50))  # 3 full pages of 16 enter the radix cache
            await _collect(client.add_requests([_req("p", prompt, SamplingParams(
                max_tokens=2, ignore_eos=True))]))
            assert core.kv.num_cached_pages == 3
            # a live request on the same prefix locks it: the flush leaves those pages
            live = client.add_requests([_req("live", prompt + [7], SamplingParams(
                max_tokens=MAX_MODEL_LEN, ignore_eos=True))])
            await asyncio.wait_for(live.next_batch(), 10)
            assert await asyncio.wait_for(client.flush_cache(), 10) == 0
            assert core.kv.num_cached_pages == 3
            live.cancel(KeyError("gone"))
            with pytest.raises(KeyError):
                while True:
                    await asyncio.wait_for(live.next_batch(), 10)
            for _ in range(100):  # the abort reaches the core within a step
                if not core.has_unfinished_requests():
                    break
                await asyncio.sleep(0.02)
            assert not core.has_unfinished_requests() and client.num_in_flight == 0
            freed = await asyncio.wait_for(client.flush_cache(), 10)
            assert freed >= 3 and core.kv.num_cached_pages == 0
            assert core.kv.num_free_pages == core.kv.num_usable_pages
        finally:
            await client.shutdown(5.0)
        with pytest.raises(EngineDeadError):
            await client.flush_cache()

    asyncio.run(main())
