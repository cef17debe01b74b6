"""The pure parts of running in production (issue 26): the one fan-out of an API request into
engine requests, ``--generation-config``'s sampling defaults (read, validated, applied to the
fields a request leaves unset over HTTP and gRPC), the request and stats log lines and the
JSON log format."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from radixserve.engine_types import SchedulerStats, StepOutputs, child_request_id, fan_out
from radixserve.entrypoints.grpc_worker.translate import (
    engine_requests_from_proto,
    sampling_params_from_proto,
)
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.entrypoints.openai.serving_request import sampling_params_for
from radixserve.entrypoints.request_log import RequestLogger, StatsLogger
from radixserve.frontend.generation_config import sampling_defaults
from radixserve.frontend.output_processor import RequestState
from radixserve.logs import JsonFormatter
from radixserve.sampling_params import SamplingParams

# -- fan-out -------------------------------------------------------------------------------------


def test_fan_out_ids_and_children() -> None:
    sp = SamplingParams(n=2, seed=5, temperature=1.0)
    reqs = fan_out("rid", [[1, 2], np.array([3])], sp, 7.0)
    assert [r.request_id for r in reqs] == ["rid-0", "rid-1", "rid-2", "rid-3"]
    assert [r.sampling_params.seed for r in reqs] == [5, 6, 5, 6]
    assert all(r.sampling_params.n == 1 and r.arrival_time == 7.0 for r in reqs)
    assert all(r.prompt_token_ids.dtype == np.int32 for r in reqs)
    (one,) = fan_out("rid", [[1]], SamplingParams(), 0.0, {"do_remote_decode": True})
    assert one.request_id == "rid" and one.kv_transfer_params == {"do_remote_decode": True}
    assert child_request_id("x", 0, 1) == "x" and child_request_id("x", 3, 4) == "x-3"


# -- generation config ---------------------------------------------------------------------------


def _folder(tmp_path: Path, data: object) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps(data))
    return tmp_path


def test_sampling_defaults_read_like_vllm(tmp_path: Path) -> None:
    model = _folder(tmp_path / "m", {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 7, "do_sample": True,
        "eos_token_id": [1, 2], "bos_token_id": 1})
    assert sampling_defaults("auto", model) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_tokens": 7}
    assert sampling_defaults("vllm", model) == {}
    # a folder of its own overrides the model's
    other = _folder(tmp_path / "o", {"temperature": 0})
    assert sampling_defaults(str(other), model) == {"temperature": 0.0}
    # Hugging Face's own defaults recommend nothing (vLLM reads to_diff_dict); top_k 0 is off
    plain = _folder(tmp_path / "p", {"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                                     "repetition_penalty": 1.0, "eos_token_id": 2})
    assert sampling_defaults("auto", plain) == {}
    assert sampling_defaults("auto", _folder(tmp_path / "k", {"top_k": 0})) == {"top_k": -1}
    # no file: nothing for auto, an error for a folder named on purpose
    assert sampling_defaults("auto", tmp_path / "none") == {}
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(str(tmp_path / "none"), model)


@pytest.mark.parametrize("data, match", [
    ([1], "not a JSON object"), ({"temperature": "hot"}, "temperature"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"), ({"top_p": 2.0}, "top_p"),
    ({"temperature": -1}, "temperature")])
def test_bad_generation_config_fails_at_start(tmp_path: Path, data: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sampling_defaults(str(_folder(tmp_path, data)), tmp_path)


DEFAULTS = {"temperature": 0.25, "top_p": 0.5, "top_k": 4, "min_p": 0.1,
            "repetition_penalty": 1.2, "max_tokens": 9}


def test_http_defaults_fill_only_unset_fields() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    req = ChatCompletionRequest.model_validate({"messages": msgs})
    sp = sampling_params_for(req, 10, 100, None, "messages", None, DEFAULTS)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty,
            sp.max_tokens) == (0.25, 0.5, 4, 0.1, 1.2, 9)
    # set fields win, an explicit null is unset; max_tokens is capped at the room left
    req = ChatCompletionRequest.model_validate({"messages": msgs, "temperature": 1.0,
                                                "top_k": None, "max_tokens": 3})
    sp = sampling_params_for(req, 10, 100, None, "messages", None, DEFAULTS)
    assert (sp.temperature, sp.top_k, sp.max_tokens) == (1.0, 4, 3)
    sp = sampling_params_for(ChatCompletionRequest.model_validate({"messages": msgs}), 95, 100,
                             None, "messages", None, DEFAULTS)
    assert sp.max_tokens == 5
    # completions: the model's max_tokens replaces OpenAI's 16
    sp = sampling_params_for(CompletionRequest.model_validate({"prompt": "x"}), 1, 100, 16,
                             "prompt", None, DEFAULTS)
    assert sp.max_tokens == 9 and sp.temperature == 0.25
    # without defaults: the server's own
    sp = sampling_params_for(CompletionRequest.model_validate({"prompt": "x"}), 1, 100, 16,
                             "prompt")
    assert (sp.max_tokens, sp.temperature, sp.top_k) == (16, 1.0, -1)


def test_grpc_defaults_fill_only_unset_fields() -> None:
    sp = sampling_params_from_proto(pb.SamplingParams(), DEFAULTS)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty,
            sp.max_tokens) == (0.25, 0.5, 4, 0.1, 1.2, 9)
    sp = sampling_params_from_proto(pb.SamplingParams(temperature=0.0, top_k=2, max_tokens=4),
                                    DEFAULTS)
    assert (sp.temperature, sp.top_k, sp.max_tokens) == (0.0, 2, 4)
    req = pb.GenerateRequest(request_id="g", tokenized=pb.TokenizedInput(input_ids=[5, 6]),
                             sampling_params=pb.SamplingParams(n=2))
    reqs = engine_requests_from_proto(req, lambda t: [1], 100, None, DEFAULTS)
    assert [r.request_id for r in reqs] == ["g-0", "g-1"]  # fan_out's ids
    assert all(r.sampling_params.temperature == 0.25 for r in reqs)


# -- log lines -----------------------------------------------------------------------------------


class _Detok:
    def __init__(self, n: int) -> None:
        self.token_ids = [0] * n


def _state(rid: str, out: int, finish: str | None) -> RequestState:
    st = RequestState(rid, 0, np.array([1, 2, 3], dtype=np.int32), SamplingParams(), 100.0,
                      _Detok(out))  # type: ignore[arg-type]
    st.num_cached_tokens = 2
    st.first_token_time = 100.5
    st.finish_reason = finish
    return st


def test_request_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.requests")
    RequestLogger().finished([_state("a-0", 4, "stop"), _state("a-1", 1, None)], 100.0,
                             decode=lambda ids: "SECRET")
    first, second = caplog.records
    assert first.getMessage().startswith("finished request a-0: prompt_tokens=3 "
                                         "cached_tokens=2 output_tokens=4 ttft_s=0.5 ")
    assert first.fields["finish_reason"] == "stop"
    assert second.fields["finish_reason"] == "abort"  # ended without finishing
    assert "SECRET" not in caplog.text  # no prompt without log_prompts
    caplog.clear()
    RequestLogger(log_prompts=True).finished([_state("b", 1, "length")], 100.0,
                                             decode=lambda ids: "SECRET")
    assert caplog.records[0].fields["prompt"] == "SECRET" and "'SECRET'" in caplog.text
    caplog.clear()
    RequestLogger(enabled=False).finished([_state("c", 1, "stop")], 100.0)
    assert not caplog.records


def test_stats_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.stats")
    st = StatsLogger(interval_s=2.0)
    assert not st.log(None, now=0.0)
    busy = SchedulerStats(num_running=3, num_waiting=1, kv_pages_used=25, kv_pages_total=100,
                          prefix_queried_tokens=100, prefix_hit_tokens=40, prompt_tokens=300,
                          prefill_tokens=200, generation_tokens=50)
    assert st.log(busy, now=2.0)  # prompt throughput: prefill tokens computed, not arrived
    f = caplog.records[-1].fields
    assert f == {"prompt_tokens_per_s": 100.0, "generation_tokens_per_s": 25.0, "running": 3,
                 "waiting": 1, "kv_use": 0.25, "prefix_hit_rate": 0.4}
    assert "KV use 25.0%, prefix hit rate 40.0%" in caplog.records[-1].getMessage()
    idle = SchedulerStats(kv_pages_total=100, prefix_queried_tokens=100, prefix_hit_tokens=40,
                          prompt_tokens=300, prefill_tokens=200, generation_tokens=50)
    assert st.log(idle, now=4.0)  # the first idle interval shows the rates at 0
    assert caplog.records[-1].fields["generation_tokens_per_s"] == 0.0
    assert caplog.records[-1].fields["prefix_hit_rate"] == 0.4  # since start: none queried
    assert not st.log(idle, now=6.0)  # then idle intervals log nothing


def test_json_formatter() -> None:
    rec = logging.LogRecord("radixserve.requests", logging.INFO, __file__, 1, "done %s",
                            ("x",), None)
    rec.fields = {"request_id": "x", "e2e_s": 0.5}
    obj = json.loads(JsonFormatter().format(rec))
    assert obj["message"] == "done x" and obj["logger"] == "radixserve.requests"
    assert obj["level"] == "INFO" and obj["request_id"] == "x" and obj["e2e_s"] == 0.5
    assert obj["time"].endswith("Z")


def test_engine_refuses_an_id_in_use() -> None:
    """A client's id reaches the engine core as is: one that a running request, or a finished
    one whose pages are held for a KV transfer (keyed by that id), uses is refused."""
    from radixserve.config import EngineConfig
    from radixserve.core.engine_core import EngineCore
    from radixserve.engine_types import RequestRejected
    from radixserve.model_executor.null_runner import NullRunner

    engine = EngineCore(EngineConfig(page_size=16, num_pages=8, max_num_seqs=4,
                                     disable_overlap=True),
                        NullRunner(num_pages=8, max_model_len=48, vocab_size=49152))
    (req,) = fan_out("same", [[1, 2, 3]], SamplingParams(max_tokens=4), 0.0)
    engine.add_request(req)
    with pytest.raises(RequestRejected) as e:
        engine.add_request(req)
    assert (e.value.param, e.value.code) == ("request_id", "duplicate_request_id")
    engine.abort_requests(["same"], notify=False)
    engine.scheduler.held["kept"] = object()  # type: ignore[assignment] - only its key counts
    with pytest.raises(RequestRejected, match="holds KV pages"):
        engine.add_request(fan_out("kept", [[1]], SamplingParams(), 0.0)[0])
    del engine.scheduler.held["kept"]


class _RecordingPort:
    """An ``EnginePort`` fed from a script: ``script[i]`` is what the i-th ``recv_commands``
    returns (a callable is called first, for actions between two loop iterations)."""

    def __init__(self, script: list) -> None:
        self.script = script
        self.calls = 0
        self.steps: list[tuple[StepOutputs, SchedulerStats]] = []

    def recv_commands(self, timeout_ms: int | None) -> list:
        item = self.script[self.calls] if self.calls < len(self.script) else []
        self.calls += 1
        return item() if callable(item) else item

    def send_step(self, step: StepOutputs, stats: SchedulerStats) -> None:
        self.steps.append((step, stats))

    def send_flushed(self, call_id: int, pages_freed: int) -> None:
        raise AssertionError("not flushed here")

    def send_error(self, message: str) -> None:
        raise AssertionError(message)


def test_draining_engine_says_so_in_its_stats_and_refuses() -> None:
    """After ``begin_drain`` every stats snapshot says ``draining`` (the first one at once),
    a new request is refused with the code "draining", the running one finishes; on vLLM's
    wire the draining engine reads as full, so smg's overload guard routes elsewhere."""
    from radixserve.config import EngineConfig
    from radixserve.core.engine_core import EngineCore
    from radixserve.core.engine_proc import EngineLoop
    from radixserve.model_executor.null_runner import NullRunner
    from radixserve.transport import vllm_wire as vw

    engine = EngineCore(EngineConfig(page_size=16, num_pages=16, max_num_seqs=4,
                                     disable_overlap=True),
                        NullRunner(num_pages=16, max_model_len=64, vocab_size=49152))
    (first,) = fan_out("first", [[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True), 0.0)
    (late,) = fan_out("late", [[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True), 0.0)
    loop: EngineLoop | None = None

    def drain_then_send_late() -> list:
        assert loop is not None
        loop.begin_drain(60.0)
        return [late]

    port = _RecordingPort([[first], [], drain_then_send_late])
    loop = EngineLoop(engine, port, parent_pid=None)
    assert loop.run() == "drained: no request running"
    flags = [stats.draining for _, stats in port.steps]
    assert flags[:2] == [False, False] and all(flags[2:]) and len(flags) > 3
    outs = [o for step, _ in port.steps for o in step.outputs]
    (refused,) = [o for o in outs if o.request_id == "late"]
    assert refused.error_code == "draining" and refused.finish_reason == "abort"
    assert [o.finish_reason for o in outs if o.request_id == "first"][-1] == "length"
    wire = vw.StatsDelta()
    before, during = wire(port.steps[0][1], 1), wire(port.steps[2][1], 3)
    assert before["kv_cache_usage"] < 1.0 and before["num_waiting_reqs"] == 0
    assert during["kv_cache_usage"] == 1.0
    assert during["num_waiting_reqs"] >= vw.DRAINING_WAITING_REQS
