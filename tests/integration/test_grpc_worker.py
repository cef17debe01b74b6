"""``radixserve serve --grpc`` spoken to directly with grpcio and smg-grpc-proto's stubs (the
``vllm.grpc.engine.VllmEngine`` service smg calls): every RPC, every sampling field the engine
supports (output constraints and ``logit_bias`` included), refusals naming the field, Abort /
cancel / FlushCache freeing KV pages, SIGTERM."""

from __future__ import annotations

import hashlib
import io
import json
import re
import signal
import threading
import time
import zipfile

import grpc
import httpx
import jsonschema
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_utils import GrpcWorker, descendants
from server_utils import HANG_TIMEOUT_S, metrics_values, pid_alive, wait_idle, wait_until
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

NUM_PAGES = 128
PROMPT = [1, 4093, 198, 36218, 15876, 2, 198, 1, 520, 9531, 198]  # a chat-templated "hi"


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory):
    # a short drain: the SIGTERM test sees a stream outlive it (test_production.py drains)
    w = GrpcWorker(["--dtype", "float32", "--num-pages", str(NUM_PAGES), "--max-num-seqs", "16",
                    "--seed", "0", "--shutdown-timeout", "1"],
                   tmp_path_factory.mktemp("grpc_worker"))
    try:
        w.wait_ready()
        yield w
    finally:
        w.stop()


@pytest.fixture(scope="module")
def stub(worker: GrpcWorker):
    return worker.stub()


@pytest.fixture(scope="module")
def hf_tok(stub):
    """The worker's tokenizer (``GetModelInfo.tokenizer_path``), to read outputs as text."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stub.GetModelInfo(pb.GetModelInfoRequest())
                                         .tokenizer_path)


def _gen(rid: str, stream: bool = False, prompt: list[int] = PROMPT, **sp) -> pb.GenerateRequest:
    sp.setdefault("temperature", 0.0)
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=prompt),
                              sampling_params=pb.SamplingParams(**sp), stream=stream)


def _completes(stub, req: pb.GenerateRequest) -> list[pb.GenerateComplete]:
    out = [r.complete for r in stub.Generate(req, timeout=HANG_TIMEOUT_S)
           if r.WhichOneof("response") == "complete"]
    return sorted(out, key=lambda c: c.index)


def test_info_rpcs(worker: GrpcWorker, stub) -> None:
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy
    health = health_pb2_grpc.HealthStub(worker.channel())
    for service in ("", "vllm.grpc.engine.VllmEngine"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == (
            health_pb2.HealthCheckResponse.SERVING)
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.served_model_name == "SmolLM2-135M-Instruct" and info.is_generation
    assert info.max_context_length == (NUM_PAGES - 1) * 16 and info.vocab_size == 49152
    assert list(info.eos_token_ids) == [2] and info.model_type == "llama"
    assert list(info.architectures) == ["LlamaForCausalLM"] and info.tokenizer_path
    server = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert server.server_type == "radixserve-grpc" and server.max_num_seqs == 16
    assert server.block_size == 16 and server.kv_connector == "" and server.model_dtype == (
        "float32")
    assert server.kv_role == server.kv_engine_id == server.pairing_protocol == ""
    assert server.constrained_decoding_start == "first_token"
    loads = stub.GetLoads(pb.GetLoadsRequest(include=["core"]))
    assert loads.dp_rank_count == 1 and len(loads.loads) == 1
    assert loads.loads[0].max_total_num_tokens == (NUM_PAGES - 1) * 16
    assert loads.loads[0].max_running_requests == 16
    with pytest.raises(grpc.RpcError) as e:
        stub.Embed(pb.EmbedRequest(request_id="e"))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_get_tokenizer_ships_a_loadable_tokenizer(stub, tmp_path) -> None:
    from transformers import AutoTokenizer

    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(c.sha256 == "" for c in chunks[:-1])
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    assert not list(tmp_path.glob("*.safetensors"))
    shipped = AutoTokenizer.from_pretrained(tmp_path)
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    ours = AutoTokenizer.from_pretrained(info.tokenizer_path)
    msgs = [{"role": "user", "content": "hi"}]
    text = ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert shipped.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == text
    assert shipped.encode(text, add_special_tokens=False) == ours.encode(
        text, add_special_tokens=False)
    assert shipped.eos_token == ours.eos_token == "<|im_end|>"


def test_stream_and_non_stream_give_the_same_tokens(stub) -> None:
    (whole,) = _completes(stub, _gen("ns", max_tokens=8, ignore_eos=True))
    assert whole.finish_reason == "length" and whole.completion_tokens == 8
    assert len(whole.output_ids) == 8 and whole.prompt_tokens == len(PROMPT)
    streamed, final = [], []
    for r in stub.Generate(_gen("s", stream=True, max_tokens=8, ignore_eos=True),
                           timeout=HANG_TIMEOUT_S):
        if r.WhichOneof("response") == "chunk":
            assert r.chunk.completion_tokens == len(r.chunk.token_ids)
            streamed += r.chunk.token_ids
        else:
            final.append(r.complete)
    assert streamed == list(whole.output_ids)
    assert len(final) == 1 and final[0].finish_reason == "length"
    assert list(final[0].output_ids) == streamed[-len(final[0].output_ids):]


def test_n_choices_seeds_and_logprobs(stub) -> None:
    kw = dict(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True, logprobs=3)
    a = _completes(stub, _gen("n1", **kw))
    b = _completes(stub, _gen("n2", **kw))
    assert [c.index for c in a] == [0, 1]
    assert [list(c.output_ids) for c in a] == [list(c.output_ids) for c in b]  # seeded
    assert list(a[0].output_ids) != list(a[1].output_ids)  # choice i gets seed + i
    for c in a:
        lp = c.output_logprobs
        assert list(lp.token_ids) == list(c.output_ids)
        assert len(lp.token_logprobs) == 6 and all(v <= 0 for v in lp.token_logprobs)
        assert all(len(t.token_ids) == 3 for t in lp.top_logprobs)
    streamed = {0: [], 1: []}
    for r in stub.Generate(_gen("n3", stream=True, **kw), timeout=HANG_TIMEOUT_S):
        if r.WhichOneof("response") == "chunk":
            streamed[r.chunk.index] += r.chunk.token_ids
    assert [streamed[0], streamed[1]] == [list(c.output_ids) for c in a]


def test_penalties_min_tokens_and_stops(stub) -> None:
    (greedy,) = _completes(stub, _gen("g", max_tokens=10, ignore_eos=True))
    ids = list(greedy.output_ids)
    (pen,) = _completes(stub, _gen("p", max_tokens=10, ignore_eos=True,
                                   repetition_penalty=1.8, frequency_penalty=1.5))
    assert list(pen.output_ids) != ids  # the penalties were applied
    (by_id,) = _completes(stub, _gen("st", max_tokens=10, stop_token_ids=[ids[3]]))
    assert by_id.finish_reason == "stop" and by_id.matched_token_id == ids[3]
    assert list(by_id.output_ids) == ids[:ids.index(ids[3]) + 1]
    (late,) = _completes(stub, _gen("mt", max_tokens=10, stop_token_ids=[ids[0]],
                                    min_tokens=4))
    assert len(late.output_ids) >= 4  # stop ids suppressed until min_tokens
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stub.GetModelInfo(pb.GetModelInfoRequest())
                                        .tokenizer_path)
    text = tok.decode(ids)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    (by_str,) = _completes(stub, _gen("ss", max_tokens=10, ignore_eos=True, stop=[stop],
                                      skip_special_tokens=True))
    assert by_str.finish_reason == "stop" and by_str.matched_stop_str == stop
    assert len(by_str.output_ids) < 10 and stop not in tok.decode(by_str.output_ids[:-1])


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "Rome", "Lima"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}


def _chat_ids(hf_tok, text: str) -> list[int]:
    text = hf_tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=False)
    return hf_tok.encode(text, add_special_tokens=False)


def test_json_schema_constrained_output_validates(stub, hf_tok) -> None:
    """The ``json_schema`` member of the constraint oneof: greedy or sampled, streamed or not,
    the output is JSON that validates against the schema."""
    prompt = _chat_ids(hf_tok, "Describe a fictional person as JSON.")
    schema = json.dumps(PERSON)
    (greedy,) = _completes(stub, _gen("js0", prompt=prompt, max_tokens=60,
                                      json_schema=schema))
    assert greedy.finish_reason == "stop", hf_tok.decode(greedy.output_ids)
    streamed, finish = [], None
    for r in stub.Generate(_gen("js1", stream=True, prompt=prompt, max_tokens=60,
                                json_schema=schema, temperature=1.0, seed=9),
                           timeout=HANG_TIMEOUT_S):
        if r.WhichOneof("response") == "chunk":
            streamed += r.chunk.token_ids
        else:
            finish = r.complete.finish_reason
    assert finish == "stop"
    for ids in (list(greedy.output_ids), streamed):
        jsonschema.validate(json.loads(hf_tok.decode(ids, skip_special_tokens=True)), PERSON)


def test_regex_choice_grammar_and_json_object(stub, hf_tok) -> None:
    prompt = _chat_ids(hf_tok, "Name a city.")
    cases = [(dict(regex=r"[A-Z][a-z]{2,8}-[0-9]{3}", temperature=1.0, seed=1, n=2),
              lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}-[0-9]{3}", t)),
             (dict(choice=pb.ChoiceConstraint(choices=["Paris", "Lima", "Oslo"]),
                   temperature=1.0, seed=2, n=2), lambda t: t in ("Paris", "Lima", "Oslo")),
             (dict(grammar='root ::= ("yes" | "no") "."'), lambda t: t in ("yes.", "no."))]
    for i, (constraint, ok) in enumerate(cases):
        for c in _completes(stub, _gen(f"c{i}", prompt=prompt, max_tokens=20, **constraint)):
            text = hf_tok.decode(c.output_ids, skip_special_tokens=True)
            assert c.finish_reason == "stop" and ok(text), (constraint, text)
    ask = _chat_ids(hf_tok, "Reply with a JSON object with the keys name and age of a "
                            "fictional person.")
    (obj,) = _completes(stub, _gen("cj", prompt=ask, max_tokens=60, json_object=True))
    text = hf_tok.decode(obj.output_ids, skip_special_tokens=True)
    assert obj.finish_reason == "stop" and isinstance(json.loads(text), dict), text


def test_logit_bias_moves_the_greedy_choice(stub, hf_tok) -> None:
    (plain,) = _completes(stub, _gen("lb0", max_tokens=3, ignore_eos=True))
    first = plain.output_ids[0]
    other = hf_tok.convert_tokens_to_ids("Paris")
    assert other != first
    (up,) = _completes(stub, _gen("lb1", max_tokens=3, ignore_eos=True,
                                  logit_bias={other: 100.0}))
    assert list(up.output_ids) == [other] * 3
    (down,) = _completes(stub, _gen("lb2", max_tokens=1, logit_bias={first: -100.0}))
    assert down.output_ids[0] != first


@pytest.mark.parametrize("req,field", [
    (_gen("b1", json_schema='{"type": "no-such-type"}'), "sampling_params.json_schema"),
    (_gen("b1j", json_schema="{not json"), "sampling_params.json_schema"),
    (_gen("b1r", regex="(unclosed"), "sampling_params.regex"),
    (_gen("b1g", grammar="root ::= undefined_rule"), "sampling_params.grammar"),
    (_gen("b1s", structural_tag='{"type": "structural_tag"}'),
     "sampling_params.structural_tag"),
    (_gen("b2", logit_bias={60000: 3.0}), "sampling_params.logit_bias"),
    (_gen("b3", temperature=-1.0), "sampling_params.temperature"),
    # well-formed params, but this worker has no --kv-transfer-config: the engine refuses
    (pb.GenerateRequest(request_id="b4", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                        kv_transfer_params_json='{"do_remote_decode": true}'),
     "kv_transfer_params_json"),
    (pb.GenerateRequest(request_id="b4j", tokenized=pb.TokenizedInput(input_ids=PROMPT),
                        kv_transfer_params_json='{"do_remote_prefill": true}'),
     "kv_transfer_params_json"),
    (_gen("b5", prompt=[5] * ((NUM_PAGES - 1) * 16)), "prompt"),
    (_gen("b6", prompt=[60000]), "prompt"),
])
def test_bad_requests_are_invalid_argument_naming_the_field(worker, stub, req, field) -> None:
    with pytest.raises(grpc.RpcError) as e:
        _completes(stub, req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field), e.value.details()
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy
    wait_idle(worker.metrics_url)


def _first_chunk_then(stub, rid: str, action) -> grpc.RpcError | None:
    """Start a long stream, run ``action`` after its first chunk, return how it ended."""
    call = stub.Generate(_gen(rid, stream=True, max_tokens=3000, ignore_eos=True),
                         timeout=HANG_TIMEOUT_S)
    try:
        for i, _ in enumerate(call):
            if i == 0:
                action(call)
    except grpc.RpcError as e:
        return e
    return None


def aborted(metrics_url: str) -> float:
    """``radixserve:request_success_total{finished_reason="abort"}`` (0 before the first)."""
    for line in httpx.get(metrics_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("radixserve:request_success_total") and '"abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_abort_rpc_ends_the_stream_and_frees_its_pages(worker, stub) -> None:
    before = aborted(worker.metrics_url)
    err = _first_chunk_then(stub, "ab", lambda _: stub.Abort(pb.AbortRequest(
        request_ids=["ab", "no-such-request"])))
    assert err is not None and err.code() == grpc.StatusCode.CANCELLED
    wait_idle(worker.metrics_url)  # no running request, every used page a cached one
    assert aborted(worker.metrics_url) == before + 1


def test_client_cancel_aborts_in_the_engine(worker, stub) -> None:
    err = _first_chunk_then(stub, "cc", lambda call: call.cancel())
    assert err is not None and err.code() == grpc.StatusCode.CANCELLED
    wait_idle(worker.metrics_url)
    # the id is free again: the worker forgot the cancelled request
    (c,) = _completes(stub, _gen("cc", max_tokens=2))
    assert c.completion_tokens >= 1


def test_duplicate_request_id_while_in_flight(stub) -> None:
    started = threading.Event()
    result: list[object] = []

    def long_one() -> None:
        result.append(_first_chunk_then(stub, "dup", lambda _: started.set()))

    t = threading.Thread(target=long_one)
    t.start()
    assert started.wait(HANG_TIMEOUT_S)
    with pytest.raises(grpc.RpcError) as e:
        _completes(stub, _gen("dup", max_tokens=2))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stub.Abort(pb.AbortRequest(request_ids=["dup"]))
    t.join(HANG_TIMEOUT_S)
    assert not t.is_alive()


def test_flush_cache_evicts_unlocked_pages(worker, stub) -> None:
    _completes(stub, _gen("fc", prompt=list(range(100, 200)), max_tokens=2))
    cached = wait_idle(worker.metrics_url)["radixserve:kv_cache_pages_cached"]
    assert cached >= 6
    resp = stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=0))
    assert resp.success and f"{int(cached)} KV pages freed" in resp.message
    m = wait_until(lambda: (v := metrics_values(worker.metrics_url))[
        "radixserve:kv_cache_pages_cached"] == 0 and v, "the flushed cache in /metrics")
    assert m["radixserve:kv_cache_pages_used"] == 0
    with pytest.raises(grpc.RpcError) as e:
        stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=-1))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_sigterm_ends_streams_and_exits_0(worker, stub) -> None:
    """Last in this module: it stops the shared worker. A stream still running when the
    drain's time (``--shutdown-timeout 1``) is up ends with UNAVAILABLE."""
    engine = descendants(worker.proc.pid)
    err = _first_chunk_then(stub, "term",
                            lambda _: worker.proc.send_signal(signal.SIGTERM))
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
    assert worker.proc.wait(HANG_TIMEOUT_S) == 0
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in engine)
