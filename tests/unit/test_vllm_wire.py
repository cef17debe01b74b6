"""vLLM's EngineCore wire as smg speaks it (``transport.vllm_wire``): smg's handshake port
formula, its ADD payload (a request array as smg 1.13 sent it, seen on the wire) into an
``EngineRequest``, refusals naming the field, and the ``EngineCoreOutputs`` arrays the engine
sends back (decoded the way vLLM's decoder reads them)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from radixserve.engine_types import (
    EngineInfo,
    RequestRejected,
    SchedulerStats,
    StepOutputs,
    TokenOutput,
)
from radixserve.transport import vllm_wire as vw


def test_handshake_address_is_smgs_hash_of_the_ipc_path() -> None:
    # smg's own test vectors (bindings/python/tests/test_serve.py)
    assert vw.handshake_address("ipc:///tmp/smg-zmq/ts0.ipc") == "tcp://127.0.0.1:25152"
    assert vw.handshake_address("ipc:///tmp/smg-zmq/engine-31000") == "tcp://127.0.0.1:22714"
    assert vw.handshake_address("tcp://10.0.0.2:5555") == "tcp://10.0.0.2:5555"
    with pytest.raises(ValueError, match="ipc://PATH"):
        vw.handshake_address("http://127.0.0.1:8000")


def _sampling(**kw) -> dict:
    # the keys smg 1.13 always sends, greedy chat request
    sp = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
          "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
          "max_tokens": 12, "min_tokens": 0, "stop_token_ids": [2, 7],
          "_all_stop_token_ids": [0, 2, 7], "_eos_token_id": 2}
    sp.update(kw)
    return {k: v for k, v in sp.items() if v is not None}


def _add(sp: dict, **fields) -> list:
    req = ["cmpl-abc-0", [19556, 665], None, sp, None, 1795465300.13, None, None, None, None,
           None, 0, 0, 0, None, False, None, None, None, False, None]
    names = {"mm_features": 2, "lora_request": 6, "data_parallel_rank": 8, "priority": 13,
             "abort_immediately": 19}
    for k, v in fields.items():
        req[names[k]] = v
    return req


def test_add_request_as_smg_sends_it() -> None:
    er = vw.request_from_vllm(_add(_sampling(seed=5, logprobs=2)))
    assert er.request_id == "cmpl-abc-0"
    assert er.prompt_token_ids.dtype == np.int32 and er.prompt_token_ids.tolist() == [19556, 665]
    assert er.arrival_time == pytest.approx(1795465300.13)
    sp = er.sampling_params
    assert sp.greedy and sp.top_k == -1 and sp.max_tokens == 12 and sp.seed == 5
    assert sp.logprobs == 2 and not sp.ignore_eos
    # the EOS ends the request as an EOS (no stop_reason); the other stop id stays a stop id
    assert er.eos_token_ids == [2] and sp.stop_token_ids == [7]
    assert not vw.abort_immediately(_add(_sampling()))
    assert vw.abort_immediately(_add(_sampling(), abort_immediately=True))


def test_ignore_eos_is_an_absent_eos_id() -> None:
    er = vw.request_from_vllm(_add(_sampling(_eos_token_id=None, stop_token_ids=[])))
    assert er.sampling_params.ignore_eos and er.eos_token_ids is None


def test_structured_outputs_and_logit_bias_map_to_radixserve_fields() -> None:
    so = {"json": {"type": "object"}, "_backend": "guidance"}
    sp = vw.request_from_vllm(_add(_sampling(structured_outputs=so,
                                             logit_bias={"5": -100.0}))).sampling_params
    assert sp.structured_outputs is not None and sp.structured_outputs.kind == "json"
    assert sp.logit_bias == {5: -100.0}


@pytest.mark.parametrize(("add", "param"), [
    (_add(_sampling(allowed_token_ids=[1, 2])), "sampling_params.allowed_token_ids"),
    (_add(_sampling(thinking_token_budget=10)), "sampling_params.thinking_token_budget"),
    (_add(_sampling(structured_outputs={"structural_tag": "{}"})),
     "sampling_params.structured_outputs.structural_tag"),
    (_add(_sampling(temperature=-1.0)), "sampling_params.temperature"),
    (_add(_sampling(logprobs=-1)), "sampling_params.logprobs"),
    (_add(_sampling(), mm_features=[{"x": 1}]), "mm_features"),
    (_add(_sampling(), lora_request=["a", 1, "/p"]), "lora_request"),
    (_add(_sampling(), data_parallel_rank=1), "data_parallel_rank"),
    (_add(_sampling(), priority=3), "priority"),
    (["r", [1, 2], None, None, None, 0.0], "sampling_params"),
    (["r", [1, -2], None, _sampling(), None, 0.0], "prompt_token_ids"),
    (["r", [1]], "EngineCoreRequest"),
])
def test_what_radixserve_cannot_honour_is_refused_naming_the_field(add, param) -> None:
    with pytest.raises(RequestRejected) as e:
        vw.request_from_vllm(add)
    assert e.value.param == param and param in str(e.value)


def _decode(msg: list) -> list:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(msg))


def _nd(a: list) -> np.ndarray:
    dtype, shape, data = a
    assert isinstance(data, msgspec.msgpack.Ext) and data.code == 3
    return np.frombuffer(data.data, dtype=dtype).reshape(shape)


def test_step_outputs_as_engine_core_outputs() -> None:
    first = TokenOutput(request_id="a", new_token_ids=[11], num_prompt_tokens=40,
                        num_cached_tokens=32,
                        logprobs=[[[11.0, -0.5, 1.0], [11.0, -0.5], [12.0, -1.5]]])
    done = TokenOutput(request_id="b", new_token_ids=[7], finish_reason="stop", stop_reason=7)
    long = TokenOutput(request_id="c", new_token_ids=[3], finish_reason="length")
    bad = TokenOutput(request_id="d", finish_reason="abort", error="prompt: too long",
                      error_param="prompt")
    step = StepOutputs(step=9, outputs=[first, done, long, bad], decode_request_ids=["e", "f"],
                       decode_token_ids=np.array([5, 6], dtype=np.int32))
    stats = vw.StatsDelta()
    s = SchedulerStats(num_running=3, num_waiting=1, kv_pages_total=101, kv_pages_used=25,
                       prefix_queried_tokens=40, prefix_hit_tokens=32)
    msg = _decode(vw.outputs_message(step, stats(s, 9)))
    engine_index, outs, sched, _ts, utility, finished = msg
    assert engine_index == 0 and utility is None and finished == ["b", "c", "d"]
    by_id = {o[0]: o for o in outs}
    assert by_id["e"] == ["e", [5]] and by_id["f"] == ["f", [6]]
    a = by_id["a"]
    assert a[1] == [11] and a[5] is None  # still running
    assert a[11] == {"num_prompt_tokens": 40, "num_computed_tokens": 8, "num_cached_tokens": 32,
                     "num_local_cached_tokens": 32, "num_external_cached_tokens": 0,
                     "num_cache_creation_tokens": 8}
    ids, lps, ranks, cu = a[2]
    assert _nd(ids).tolist() == [[11, 11, 12]] and _nd(ids).dtype == np.int64
    assert _nd(lps).dtype == np.float32 and _nd(lps).tolist() == [[-0.5, -0.5, -1.5]]
    assert _nd(ranks).tolist() == [1] and cu is None
    assert by_id["b"][5] == vw.FINISH_CODE_STOP and by_id["b"][6] == 7
    assert by_id["c"][5] == vw.FINISH_CODE_LENGTH
    assert by_id["d"][5] == vw.FINISH_CODE_ERROR  # smg answers it with a 500
    assert sched["num_running_reqs"] == 3 and sched["num_waiting_reqs"] == 1
    assert sched["kv_cache_usage"] == pytest.approx(0.25)
    assert sched["prefix_cache_stats"]["queries"] == 40 and sched["prefix_cache_stats"]["hits"] == 32
    # the prefix figures are per message, as vLLM's
    again = stats(s, 10)
    assert again["prefix_cache_stats"]["queries"] == 0 and again["prefix_cache_stats"]["hits"] == 0
    # a warm radix cache is not load: smg's overload guard reads kv_cache_usage
    warm = msgspec.structs.replace(s, kv_pages_used=95, kv_pages_evictable=90)
    assert stats(warm, 11)["kv_cache_usage"] == pytest.approx(0.05)


def test_utility_reply_and_registration() -> None:
    assert _decode(vw.utility_reply(4, True))[4] == [4, None, [None, True]]
    assert _decode(vw.utility_reply(5, failure="no"))[4] == [5, "no", None]
    info = EngineInfo(model_name="m", folder="/x", max_model_len=2048, vocab_size=100,
                      eos_token_ids=[2], dtype="null", device="cpu", num_pages=65, page_size=16)
    reg = vw.ready_response(info, 32, 1024, "i")
    for key in ("max_model_len", "num_gpu_blocks", "block_size", "dtype", "vllm_version",
                "world_size", "data_parallel_size"):  # what smg requires
        assert key in reg
    assert reg["dtype"] == "float32" and reg["num_gpu_blocks"] == 64
    assert reg["kv_cache_size_tokens"] == 1024 and reg["data_parallel_size"] == 1


def test_port_turns_smg_frames_into_engine_commands() -> None:
    """ADD, ABORT and vLLM's ``reset_prefix_cache`` utility as the engine loop's commands;
    a refused ADD becomes the request's terminal output (``error`` set, the field named)."""
    from radixserve.engine_types import EngineRequest
    from radixserve.transport.messages import AbortRequests, FlushCache
    from radixserve.transport.vllm_zmq import VllmEnginePort

    port = VllmEnginePort("tcp://127.0.0.1:9")  # no socket is opened before the handshake
    try:
        enc = msgspec.msgpack.encode
        cmds: list = []
        port._command([vw.REQUEST_ADD, enc(_add(_sampling()))], cmds)
        port._command([vw.REQUEST_ADD, enc(_add(_sampling(allowed_token_ids=[3])))], cmds)
        port._command([vw.REQUEST_ADD, enc(_add(_sampling(), abort_immediately=True))], cmds)
        port._command([vw.REQUEST_ABORT, enc(["cmpl-abc-0"])], cmds)
        port._command([vw.REQUEST_UTILITY, enc([0, 7, "reset_prefix_cache", []])], cmds)
        port._command([vw.REQUEST_ADD, b"\xc1"], cmds)  # undecodable: logged, dropped
        assert isinstance(cmds[0], EngineRequest) and cmds[0].request_id == "cmpl-abc-0"
        assert isinstance(cmds[1], TokenOutput) and cmds[1].request_id == "cmpl-abc-0"
        assert cmds[1].error_param == "sampling_params.allowed_token_ids"
        assert isinstance(cmds[2], EngineRequest) and cmds[3] == AbortRequests(["cmpl-abc-0"])
        assert cmds[4:] == [AbortRequests(["cmpl-abc-0"]), FlushCache(7)]
    finally:
        port.close()
