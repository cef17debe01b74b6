"""The gRPC worker's pure parts: proto ``SamplingParams`` / ``GenerateRequest`` -> engine
requests (every field mapped or refused by name: output constraints, ``logit_bias``,
``kv_transfer_params_json``), the constraint compile check, ``RequestDelta``s ->
``GenerateResponse``s (a prefill's ``kv_transfer_params_json``), ``GetServerInfo``'s pairing
protocol, the tokenizer bundle, the load report and the fleet's core split."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import zipfile

import msgspec
import numpy as np
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from radixserve.engine_types import EngineInfo, SchedulerStats
from radixserve.entrypoints.fleet import check_worker_args, core_slices
from radixserve.entrypoints.grpc_worker import tokenizer_bundle
from radixserve.entrypoints.grpc_worker.constraints import ConstraintChecker
from radixserve.entrypoints.grpc_worker.servicer import pairing_protocol
from radixserve.entrypoints.grpc_worker.translate import (
    InvalidArgument,
    chunk_response,
    complete_response,
    constraint_field,
    engine_requests_from_proto,
    kv_transfer_params_from_proto,
    output_logprobs,
    sampling_params_from_proto,
)
from radixserve.entrypoints.worker_facts import LoadReporter
from radixserve.frontend.output_processor import OutputProcessor, RequestDelta
from radixserve.kv_transfer.params import kv_transfer_params_from_json


def _req(**kw) -> pb.GenerateRequest:
    kw.setdefault("request_id", "r1")
    if "text" not in kw:
        kw.setdefault("tokenized", pb.TokenizedInput(input_ids=[5, 6, 7]))
    return pb.GenerateRequest(**kw)


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_proto_defaults_mean_what_vllm_means() -> None:
    sp = sampling_params_from_proto(pb.SamplingParams())
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty) == (1, 1.0, 1.0,
                                                                               -1, 1.0)
    assert sp.max_tokens is None and sp.seed is None and sp.logprobs is None
    assert sp.stop is None and sp.stop_token_ids is None and not sp.ignore_eos


def test_every_supported_field_is_mapped() -> None:
    sp = sampling_params_from_proto(pb.SamplingParams(
        temperature=0.0, top_p=0.5, top_k=7, min_p=0.1, frequency_penalty=0.5,
        presence_penalty=-0.5, repetition_penalty=1.2, max_tokens=9, min_tokens=2,
        stop=["\n\n", "END"], stop_token_ids=[3, 4], skip_special_tokens=True,
        spaces_between_special_tokens=True, ignore_eos=True, n=3, logprobs=4, seed=-7,
        include_stop_str_in_output=True))
    assert sp.temperature == 0.0 and sp.top_p == 0.5 and sp.top_k == 7
    assert sp.min_p == pytest.approx(0.1) and sp.frequency_penalty == 0.5
    assert sp.presence_penalty == -0.5 and sp.repetition_penalty == pytest.approx(1.2)
    assert (sp.max_tokens, sp.min_tokens, sp.n, sp.logprobs, sp.seed) == (9, 2, 3, 4, -7)
    assert sp.stop == ["\n\n", "END"] and sp.stop_token_ids == [3, 4]
    assert sp.ignore_eos and sp.skip_special_tokens and sp.include_stop_str_in_output


@pytest.mark.parametrize("field,value,want", [
    ("json_schema", '{"type": "object"}', {"json": '{"type": "object"}'}),
    ("regex", "[0-9]+", {"regex": "[0-9]+"}),
    ("grammar", "root ::= x", {"grammar": "root ::= x"}),
    ("json_object", True, {"json_object": True}),
    ("choice", pb.ChoiceConstraint(choices=["a", "b"]), {"choice": ["a", "b"]})])
def test_structured_output_constraints_are_mapped(field: str, value: object, want) -> None:
    p = pb.SamplingParams(**{field: value}, grammar_from_first_token=True)
    so = sampling_params_from_proto(p).structured_outputs
    assert so is not None and so.kind == next(iter(want))
    assert msgspec.structs.asdict(so) | want == msgspec.structs.asdict(so)
    assert constraint_field(p) == f"sampling_params.{field}"
    assert sampling_params_from_proto(pb.SamplingParams()).structured_outputs is None
    assert constraint_field(pb.SamplingParams()) is None


@pytest.mark.parametrize("field,value,msg", [
    ("structural_tag", "{}", "not supported"), ("json_object", False, "constrains nothing"),
    ("choice", pb.ChoiceConstraint(choices=[]), "non-empty list"),
    ("choice", pb.ChoiceConstraint(choices=["a", ""]), "non-empty strings")])
def test_unsupported_or_malformed_constraints_are_refused_by_name(field, value, msg) -> None:
    with pytest.raises(InvalidArgument, match=f"^sampling_params.{field}: .*{msg}") as e:
        sampling_params_from_proto(pb.SamplingParams(**{field: value}))
    assert e.value.field == f"sampling_params.{field}"


def test_logit_bias_is_mapped_and_its_ids_checked() -> None:
    sp = sampling_params_from_proto(pb.SamplingParams(logit_bias={5: 1.5, 9: -100.0}))
    assert sp.logit_bias == {5: 1.5, 9: -100.0}
    assert sampling_params_from_proto(pb.SamplingParams()).logit_bias is None
    req = _req(sampling_params=pb.SamplingParams(logit_bias={49151: 2.0}))
    (r,) = engine_requests_from_proto(req, _encode, 100, vocab_size=49152)
    assert r.sampling_params.logit_bias == {49151: 2.0}
    for bias in ({49152: 2.0}, {-1: 2.0}, {5: 101.0}, {5: float("nan")}):
        with pytest.raises(InvalidArgument) as e:
            engine_requests_from_proto(_req(sampling_params=pb.SamplingParams(logit_bias=bias)),
                                       _encode, 100, vocab_size=49152)
        assert e.value.field == "sampling_params.logit_bias", (bias, e.value)


def test_constraint_checker_names_the_field(tok) -> None:
    checker = ConstraintChecker(tok, len(tok), [tok.convert_tokens_to_ids("<|im_end|>")])
    ok = sampling_params_from_proto(pb.SamplingParams(regex="[a-z]+")).structured_outputs
    asyncio.run(checker.check(ok, "sampling_params.regex"))
    asyncio.run(checker.check(None, None))  # nothing to check: no compiler needed
    for field, value, why in [("json_schema", "{not json", "not valid JSON"),
                              ("json_schema", '{"type": "no-such-type"}', "JSON schema"),
                              ("regex", "(unclosed", "regex"),
                              ("grammar", "root ::= undefined_rule", "EBNF grammar")]:
        p = pb.SamplingParams(**{field: value})
        with pytest.raises(InvalidArgument, match=why) as e:
            asyncio.run(checker.check(sampling_params_from_proto(p).structured_outputs,
                                      constraint_field(p)))
        assert e.value.field == f"sampling_params.{field}"
        assert str(e.value).startswith(f"sampling_params.{field}: ")


@pytest.mark.parametrize("params,field", [
    (pb.SamplingParams(prompt_logprobs=1), "sampling_params.prompt_logprobs"),
    (pb.SamplingParams(temperature=-1.0), "sampling_params.temperature"),
    (pb.SamplingParams(top_p=1.5), "sampling_params.top_p"),
    (pb.SamplingParams(logprobs=-1), "sampling_params.logprobs"),
    (pb.SamplingParams(logprobs=21), "sampling_params.logprobs"),
    (pb.SamplingParams(max_tokens=2, min_tokens=3), "sampling_params.min_tokens"),
    (pb.SamplingParams(presence_penalty=3.0), "sampling_params.presence_penalty"),
    (pb.SamplingParams(min_p=1.5), "sampling_params.min_p"),
    (pb.SamplingParams(n=1000), "sampling_params.n"),
])
def test_unsupported_or_out_of_range_values_name_the_field(params, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        sampling_params_from_proto(params)
    assert e.value.field == field and str(e.value).startswith(field)


def test_request_level_fields_are_checked() -> None:
    bad = [
        (_req(request_id=""), "request_id"),
        (pb.GenerateRequest(request_id="x"), "input"),
        (_req(kv_transfer_params=pb.KvTransferParams(remote_host="h", remote_port=1)),
         "kv_transfer_params"),
        (_req(mm_inputs=pb.MultimodalInputs()), "mm_inputs"),
        (_req(media_refs=pb.MediaRefs()), "media_refs"),
        (_req(data_parallel_rank=1), "data_parallel_rank"),
        (_req(sampling_params=pb.SamplingParams(truncate_prompt_tokens=0)),
         "sampling_params.truncate_prompt_tokens"),
        (_req(tokenized=pb.TokenizedInput(input_ids=[2**32 - 1])), "tokenized.input_ids"),
    ]
    for req, field in bad:
        with pytest.raises(InvalidArgument) as e:
            engine_requests_from_proto(req, _encode, 100)
        assert e.value.field == field, (req, e.value)
    # empty KV-transfer params and rank 0 are what a plain request carries: accepted
    for ok in (_req(kv_transfer_params_json=""), _req(kv_transfer_params_json="{}"),
               _req(kv_transfer_params_json="null"), _req(data_parallel_rank=0)):
        (r,) = engine_requests_from_proto(ok, _encode, 100)
        assert r.kv_transfer_params is None


#: What a NixlConnector-style prefill instance returns (radixserve's keys included).
HANDOFF = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0",
           "remote_request_id": "r1", "remote_block_ids": [3, 4], "remote_host": "127.0.0.1",
           "remote_port": 5555, "tp_size": 1, "remote_num_tokens": 20,
           "remote_prompt_hash": "00ff"}


def test_kv_transfer_params_json_reaches_the_engine_request() -> None:
    # smg's prefill leg (max_tokens 1, ignore_eos, not streamed) and its decode leg
    prefill = _req(kv_transfer_params_json='{"do_remote_decode":true,"do_remote_prefill":false}',
                   sampling_params=pb.SamplingParams(max_tokens=1, ignore_eos=True))
    (p,) = engine_requests_from_proto(prefill, _encode, 100)
    assert p.kv_transfer_params == {"do_remote_decode": True, "do_remote_prefill": False}
    decode = _req(kv_transfer_params_json=json.dumps({**HANDOFF, "extra_key": None}))
    (d,) = engine_requests_from_proto(decode, _encode, 100)
    assert d.kv_transfer_params == HANDOFF  # nulls dropped, the rest verbatim
    assert kv_transfer_params_from_proto(_req()) is None


@pytest.mark.parametrize("text,msg", [
    ("{not json", "kv_transfer_params_json: is not valid JSON"),
    ("[1, 2]", "kv_transfer_params_json: must be a JSON object"),
    ('{"do_remote_decode": "yes"}', "kv_transfer_params_json: do_remote_decode must be bool"),
    ('{"do_remote_prefill": true}', "kv_transfer_params_json: remote_engine_id is required"),
    (json.dumps({**HANDOFF, "remote_port": 70000}), "remote_port=70000 must be in"),
    (json.dumps({**HANDOFF, "tp_size": 2}), "tp_size=2 is not supported"),
    ('{"do_remote_decode": true, "do_remote_prefill": true}', "cannot both be true"),
])
def test_bad_kv_transfer_params_json_names_the_field(text: str, msg: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        engine_requests_from_proto(_req(kv_transfer_params_json=text), _encode, 100)
    assert e.value.field == "kv_transfer_params_json" and msg in str(e.value), str(e.value)


def test_kv_transfer_params_need_one_choice() -> None:
    req = _req(kv_transfer_params_json='{"do_remote_decode": true}',
               sampling_params=pb.SamplingParams(n=2))
    with pytest.raises(InvalidArgument, match="^kv_transfer_params_json: needs n=1"):
        engine_requests_from_proto(req, _encode, 100)


def test_prompts_choices_and_truncation() -> None:
    (r,) = engine_requests_from_proto(_req(stream=True), _encode, 100)
    assert r.request_id == "r1" and r.prompt_token_ids.dtype == np.int32
    assert r.prompt_token_ids.tolist() == [5, 6, 7] and r.arrival_time > 0
    (t,) = engine_requests_from_proto(_req(text="hey"), _encode, 100)
    assert t.prompt_token_ids.tolist() == [ord("h"), ord("e"), ord("y")]
    cut = _req(sampling_params=pb.SamplingParams(truncate_prompt_tokens=2))
    assert engine_requests_from_proto(cut, _encode, 100)[0].prompt_token_ids.tolist() == [6, 7]
    whole = _req(sampling_params=pb.SamplingParams(truncate_prompt_tokens=-1))
    assert engine_requests_from_proto(whole, _encode, 2)[0].prompt_token_ids.tolist() == [6, 7]
    three = engine_requests_from_proto(
        _req(sampling_params=pb.SamplingParams(n=3, seed=10, temperature=1.0)), _encode, 100)
    assert [c.request_id for c in three] == ["r1-0", "r1-1", "r1-2"]  # engine_types.fan_out
    assert [c.sampling_params.seed for c in three] == [10, 11, 12]
    assert all(c.sampling_params.n == 1 for c in three)


def test_logprob_rows_become_output_logprobs() -> None:
    rows = [[[7, -0.5], [7, -0.5], [9, -1.5]], [[3, -2.0], [4, -0.1], [3, -2.0]]]
    lp = output_logprobs(rows, 2)
    assert list(lp.token_ids) == [7, 3] and list(lp.token_logprobs) == [-0.5, -2.0]
    assert [list(t.token_ids) for t in lp.top_logprobs] == [[7, 9], [4, 3]]
    assert [v for t in lp.top_logprobs for v in t.values] == pytest.approx([-0.5, -1.5,
                                                                            -0.1, -2.0])
    only_sampled = output_logprobs([[[7, -0.5]]], 0)
    assert list(only_sampled.token_ids) == [7] and len(only_sampled.top_logprobs) == 0
    assert output_logprobs(None, 2) is None and output_logprobs([], 2) is None


def test_chunks_and_completes_carry_the_delta_and_the_stop(tok) -> None:
    from radixserve.sampling_params import SamplingParams

    proc = OutputProcessor(tok)
    st = proc.add_request("a", [1, 2, 3], SamplingParams(logprobs=1, stop=["x"]), 0.0, index=1)
    st.num_prompt_tokens, st.num_cached_tokens = 3, 2
    d = RequestDelta("a", st, "hi", [10, 11], [[[10, -0.1], [10, -0.1]],
                                              [[11, -0.2], [12, -0.05]]])
    c = chunk_response(d).chunk
    assert list(c.token_ids) == [10, 11] and c.completion_tokens == 2 and c.index == 1
    assert (c.prompt_tokens, c.cached_tokens) == (3, 2)
    assert list(c.output_logprobs.token_ids) == [10, 11]
    st.finish_reason, st.stop_reason = "stop", "x"
    done = complete_response(st, [12], None).complete
    assert list(done.output_ids) == [12] and done.finish_reason == "stop"
    assert done.WhichOneof("matched_stop") == "matched_stop_str" and done.matched_stop_str == "x"
    st.stop_reason = 5
    assert complete_response(st, [5], None).complete.matched_token_id == 5
    st.finish_reason, st.stop_reason = "length", None
    eos = complete_response(st, [1, 2, 3], None).complete
    assert eos.WhichOneof("matched_stop") is None and eos.completion_tokens == 3
    assert eos.finish_reason == "length" and not eos.HasField("output_logprobs")
    assert not eos.HasField("kv_transfer_params_json")
    # a prefill instance's answer hands its KV over: the gateway relays the JSON verbatim
    st.kv_transfer_params = HANDOFF
    handoff = complete_response(st, [7], None).complete
    assert json.loads(handoff.kv_transfer_params_json) == HANDOFF
    assert kv_transfer_params_from_json(handoff.kv_transfer_params_json) == HANDOFF
    assert not handoff.HasField("kv_transfer_params")  # the typed (Mooncake) field stays unset


def test_pairing_protocol(monkeypatch) -> None:
    monkeypatch.delenv("SMG_PAIRING_PROTOCOL", raising=False)
    assert pairing_protocol(None) == ""
    assert pairing_protocol("TcpConnector") == "radixserve/TcpConnector"
    assert pairing_protocol("NixlConnector") != pairing_protocol("TcpConnector")
    monkeypatch.setenv("SMG_PAIRING_PROTOCOL", "site-a")
    assert pairing_protocol("TcpConnector") == pairing_protocol(None) == "site-a"


def test_tokenizer_bundle_round_trip(tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": {}}')
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{x}}"}))
    (tmp_path / "chat_template.jinja").write_text("{{x}}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 10)  # weights never travel
    data, sha = tokenizer_bundle.build_bundle(tmp_path)
    assert sha == hashlib.sha256(data).hexdigest()
    names = set(zipfile.ZipFile(io.BytesIO(data)).namelist())
    assert names == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    pieces = list(tokenizer_bundle.chunks(data, sha, chunk_size=100))
    assert b"".join(p for p, _ in pieces) == data
    assert [d for _, d in pieces] == [""] * (len(pieces) - 1) + [sha]
    with pytest.raises(FileNotFoundError):
        tokenizer_bundle.build_bundle(tmp_path / "nothing-here")


def test_load_report_from_scheduler_stats() -> None:
    r = LoadReporter()
    info = EngineInfo(model_name="m", folder="/m", max_model_len=1600, vocab_size=10,
                      eos_token_ids=[2], dtype="float32", device="cpu", num_pages=101,
                      page_size=16)
    idle = r.load(None, info, 8)
    assert idle["num_running_reqs"] == 0 and idle["max_total_num_tokens"] == 1600
    s = SchedulerStats(num_running=3, num_waiting=2, kv_pages_used=40, kv_pages_total=100,
                       kv_pages_cached=30, prefix_queried_tokens=200, prefix_hit_tokens=50)
    load = r.loads_response(s, info, 8)["loads"][0]
    assert load["num_total_reqs"] == 5 and load["max_running_requests"] == 8
    assert load["num_used_tokens"] == 640 and load["max_total_num_tokens"] == 1600
    assert load["token_usage"] == pytest.approx(0.1)  # 10 pages owned outside the cache
    assert load["cache_hit_rate"] == pytest.approx(0.25)
    pb.SchedulerLoad(**load)  # every key is a proto field
    # the rate is per second of busy time: an idle stretch does not make the engine look slow
    r.load(msgspec.structs.replace(s, generation_tokens=100), info, 8, busy_s=10.0)
    later = msgspec.structs.replace(s, generation_tokens=300)
    assert r.load(later, info, 8, busy_s=12.0)["gen_throughput"] == pytest.approx(100.0)
    assert r.load(later, info, 8, busy_s=12.0)["gen_throughput"] == pytest.approx(100.0)


def test_fleet_core_split_and_worker_args() -> None:
    assert core_slices([0, 1, 2, 3], 2, None) == [[0, 1], [2, 3]]
    assert core_slices([0, 1], 2, None) == [[0], [1]]
    assert core_slices([0, 1], 3, None) == [[0], [1], [0]]  # more workers than cores: shared
    assert core_slices([0, 1, 2, 3], 2, 1) == [[0], [1]]
    with pytest.raises(ValueError):
        core_slices([0], 0, None)
    args, serve_ns = check_worker_args(["--", "--dtype", "float32", "/models/m"])
    assert args == ["--dtype", "float32", "/models/m"] and serve_ns.model == "/models/m"
    with pytest.raises(ValueError, match="--port"):
        check_worker_args(["--port=5"])
    with pytest.raises(ValueError, match="--zmq-worker"):
        check_worker_args(["--zmq-worker", "ipc:///tmp/x"])
    with pytest.raises(SystemExit):
        check_worker_args(["--no-such-flag"])
