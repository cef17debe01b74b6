"""Prefill/decode disaggregation without a model: two ``EngineCore``s (a prefill and a decode
instance) over the KV-checksum model (``kv_checksum.py``, whose every token is a hash of the
whole sequence read back through the page table), joined by the real KV connectors (NIXL and
TCP, real sockets and threads).

A page read into the wrong place, a page freed while read, or a prompt token the decode side
computes instead of loading shows up as a wrong token or in ``prefill_tokens``; both engines run
``check_integrity`` after every step. Also: ``kv_transfer_params`` parsing, leases with a fake
clock, ``KVTransferConfig``, descriptor merging.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from kv_checksum import UNWRITTEN, VOCAB, KVChecksumRunner, expected_output

from radixserve.config import EngineConfig, KVTransferConfig
from radixserve.core.engine_core import EngineCore
from radixserve.engine_types import EngineRequest, RequestRejected
from radixserve.kv_transfer.factory import create_worker_connector
from radixserve.kv_transfer.lease import BAD_PAGES, OK, UNKNOWN, LeaseTable
from radixserve.kv_transfer.params import (
    kv_transfer_params_from_json,
    kv_transfer_params_to_json,
    parse_kv_transfer_params,
)
from radixserve.kv_transfer.worker import page_runs
from radixserve.sampling_params import SamplingParams

CONNECTORS = ["TcpConnector", "NixlConnector"]
WAIT_S = 60.0  # a guard against hangs only


# ---------------------------------------------------------------------------- harness
class PDChecksumRunner(KVChecksumRunner):
    """The checksum runner whose pool is two "layers" shaped like ``KVStorage``'s
    (``[2, num_pages, page_size, 1, 1]`` int64, the token ids in layer 0's K slots), registered
    with a real worker-side KV connector."""

    def __init__(self, num_pages: int, page_size: int, config: KVTransferConfig) -> None:
        super().__init__(num_pages, page_size, (num_pages - 1) * page_size, VOCAB)
        self.layers = [torch.full((2, num_pages, page_size, 1, 1), UNWRITTEN,
                                  dtype=torch.int64) for _ in range(2)]
        self.kv = self.layers[0][0, :, :, 0, 0].numpy()  # a view: the checksum reads these
        self.kv_connector = create_worker_connector(config, "kv-checksum")
        self.kv_connector.register_kv_caches({f"layer{i}": t for i, t in enumerate(self.layers)})


class Instance:
    """An ``EngineCore`` with a KV connector over the checksum runner, integrity checked after
    every step, and what its requests produced."""

    def __init__(self, connector: str, *, page_size: int = 4, num_pages: int = 64,
                 role: str = "kv_both", lease_s: float = 30.0, policy: str = "recompute",
                 overlap: bool = False, prefix_caching: bool = True,
                 **extra: object) -> None:
        extra.setdefault("side_channel_timeout_s", 1.0)
        self.kv_config = KVTransferConfig(
            kv_connector=connector, kv_role=role, kv_lease_s=lease_s,
            kv_load_failure_policy=policy, kv_connector_extra_config=extra)
        self.runner = PDChecksumRunner(num_pages, page_size, self.kv_config)
        self.engine = EngineCore(
            EngineConfig(page_size=page_size, num_pages=num_pages, max_num_seqs=8,
                         max_num_batched_tokens=64, disable_overlap=not overlap,
                         enable_prefix_caching=prefix_caching,
                         kv_transfer_config=self.kv_config), self.runner)
        self.engine.check_integrity_each_step = True
        self.runner.attach(self.engine)
        self.outputs: dict[str, dict] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int,
            params: dict | None = None) -> None:
        self.engine.add_request(EngineRequest(
            request_id=rid, prompt_token_ids=np.asarray(prompt, dtype=np.int32),
            sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                           ignore_eos=True),
            kv_transfer_params=params))
        self.outputs[rid] = {"tokens": [], "finish": None, "error": None, "params": None,
                             "error_code": None}

    def step(self) -> None:
        out = self.engine.step()
        if out is None:
            return
        for o in out.all_outputs():
            res = self.outputs[o.request_id]
            assert res["finish"] is None, f"{o.request_id} got output after finishing"
            res["tokens"] += list(o.new_token_ids)
            res["finish"] = o.finish_reason
            res["error"], res["error_code"] = o.error, o.error_code
            if o.kv_transfer_params is not None:
                res["params"] = o.kv_transfer_params

    def run_until(self, cond, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.step()

    def finish_all(self) -> None:
        self.run_until(lambda: all(o["finish"] for o in self.outputs.values()),
                       "every request to finish")

    def settle(self) -> None:
        """Step until no KV transfer work is left (leases ended, loads reported)."""
        self.run_until(lambda: not self.engine.has_kv_transfer_work(), "transfers to settle")

    def stats(self):
        return self.engine.get_stats()

    def assert_no_owned_pages(self) -> None:
        """Every page is free or cached: nothing held, nothing leaked."""
        self.engine.scheduler.check_integrity()
        kv = self.engine.kv
        assert not self.engine.scheduler.held
        assert kv.num_free_pages + kv.num_cached_pages == kv.num_usable_pages

    def close(self) -> None:
        self.engine.shutdown()


@pytest.fixture
def make():
    made: list[Instance] = []

    def factory(connector: str, **kw) -> Instance:
        inst = Instance(connector, **kw)
        made.append(inst)
        return inst

    yield factory
    for inst in made:
        inst.close()


def prefill(p: Instance, rid: str, prompt: list[int]) -> dict:
    """What a router does first: one token on the prefill instance with do_remote_decode;
    returns the response's kv_transfer_params."""
    p.add(rid, prompt, 1, {"do_remote_decode": True, "do_remote_prefill": False,
                           "remote_engine_id": None, "remote_block_ids": None})
    p.run_until(lambda: p.outputs[rid]["finish"], f"prefill of {rid}")
    params = p.outputs[rid]["params"]
    assert params is not None and params["do_remote_prefill"] is True
    return params


def prompts(rng: np.random.Generator, lengths: list[int]) -> list[list[int]]:
    return [rng.integers(0, VOCAB, size=n).tolist() for n in lengths]


# ---------------------------------------------------------------------------- end to end
@pytest.mark.parametrize(("connector", "overlap"), [(c, False) for c in CONNECTORS]
                         + [("TcpConnector", True)])
def test_decode_after_remote_prefill_equals_colocated(make, connector: str,
                                                      overlap: bool) -> None:
    p = make(connector, role="kv_producer", overlap=overlap)
    d = make(connector, role="kv_consumer", overlap=overlap)
    # lengths around page boundaries (page_size 4): nothing to load (1 token), a partial page,
    # exact pages, and long prompts spanning many pages
    ps = prompts(np.random.default_rng(0), [1, 2, 4, 5, 8, 9, 13, 30, 61])
    params = [prefill(p, f"p{i}", pr) for i, pr in enumerate(ps)]
    held = p.stats().kv_transfer
    assert held.held_requests == len(ps) and held.leases_granted == len(ps)
    # held pages stay in the prefill instance's radix cache: a repeat of a prompt hits them
    p.add("again", ps[-1], 1)
    p.finish_all()
    assert p.engine.scheduler.prefix_hit_tokens >= 60
    for i, (pr, kp) in enumerate(zip(ps, params, strict=True)):
        assert kp["remote_block_ids"] and kp["remote_num_tokens"] == len(pr)
        d.add(f"d{i}", pr, 6, kp)
    d.finish_all()
    for i, pr in enumerate(ps):
        out = d.outputs[f"d{i}"]
        assert out["error"] is None and out["finish"] == "length"
        assert out["tokens"] == expected_output(pr, 6)[0]
        # the decode side computed only the last prompt token (it samples the first output)
        assert d.runner.prefill_tokens(f"d{i}", len(pr)) == 1
    st = d.stats()
    assert st.prompt_tokens_local_compute == len(ps)
    assert st.prompt_tokens_external == sum(len(pr) - 1 for pr in ps)
    assert st.kv_transfer.loads_ok == len(ps) - 1  # the 1-token prompt loads nothing
    assert st.kv_transfer.pages_read == sum(-(-(len(pr) - 1) // 4) for pr in ps)
    d.settle()
    p.settle()
    assert p.stats().kv_transfer.leases_released == len(ps)
    p.assert_no_owned_pages()
    d.assert_no_owned_pages()


def test_without_prefix_caching_on_either_side(make) -> None:
    p = make("TcpConnector", prefix_caching=False)
    d = make("TcpConnector", prefix_caching=False)
    ps = prompts(np.random.default_rng(8), [7, 16, 33])
    params = [prefill(p, f"p{i}", pr) for i, pr in enumerate(ps)]
    for i, (pr, kp) in enumerate(zip(ps, params, strict=True)):
        d.add(f"d{i}", pr, 4, kp)
    d.finish_all()
    for i, pr in enumerate(ps):
        assert d.outputs[f"d{i}"]["tokens"] == expected_output(pr, 4)[0]
        assert d.runner.prefill_tokens(f"d{i}", len(pr)) == 1
    d.settle()
    p.settle()
    for inst in (p, d):
        inst.engine.scheduler.check_integrity()
        assert inst.engine.kv.num_free_pages == inst.engine.kv.num_usable_pages


def test_only_pages_missing_on_the_decode_side_are_read(make) -> None:
    p = make("TcpConnector")
    d = make("TcpConnector")
    rng = np.random.default_rng(1)
    shared = rng.integers(0, VOCAB, size=24).tolist()  # 6 pages of 4 tokens
    d.add("warm", shared + [7, 8, 9], 2)  # caches the shared prefix on the decode instance
    d.finish_all()
    prompt = shared + rng.integers(0, VOCAB, size=13).tolist()  # 37 tokens
    params = prefill(p, "p", prompt)
    assert len(params["remote_block_ids"]) == 10
    hits = d.engine.scheduler.prefix_hit_tokens
    d.add("d", prompt, 5, params)
    d.finish_all()
    assert d.outputs["d"]["tokens"] == expected_output(prompt, 5)[0]
    assert d.engine.scheduler.prefix_hit_tokens - hits == 24
    # prompt positions 0..35 are needed (9 pages), 6 were cached: 3 read
    assert d.stats().kv_transfer.pages_read == 3
    assert d.runner.prefill_tokens("d", len(prompt)) == 1
    d.settle()
    p.settle()
    p.assert_no_owned_pages()
    d.assert_no_owned_pages()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_abort_while_loading_frees_pages_on_both_sides(make, connector: str) -> None:
    p = make(connector)
    d = make(connector, load_delay_s=0.3)  # the load waits: the abort lands during it
    prompt = prompts(np.random.default_rng(2), [30])[0]
    params = prefill(p, "p", prompt)
    d.add("d", prompt, 5, params)
    d.run_until(lambda: d.stats().num_waiting_for_remote_kvs == 1, "the load to start")
    d.engine.abort_requests(["d"])
    assert d.outputs["d"]["finish"] is None
    d.step()
    assert d.outputs["d"]["finish"] == "abort"
    # the load's pages stay held until the load ended, then everything is given back
    d.settle()
    p.settle()
    assert d.stats().kv_transfer.pages_read == 0
    assert p.stats().kv_transfer.leases_released == 1
    p.assert_no_owned_pages()
    d.assert_no_owned_pages()


def test_other_requests_keep_decoding_while_one_waits_for_its_kv(make) -> None:
    p = make("TcpConnector")
    d = make("TcpConnector", load_delay_s=0.5)
    prompt, other = prompts(np.random.default_rng(9), [30, 10])
    params = prefill(p, "p", prompt)
    d.add("busy", other, 40)
    d.add("d", prompt, 5, params)
    d.run_until(lambda: d.stats().num_waiting_for_remote_kvs == 1, "the load to start")
    before = len(d.outputs["busy"]["tokens"])
    d.run_until(lambda: d.stats().num_waiting_for_remote_kvs == 0, "the load to end")
    assert len(d.outputs["busy"]["tokens"]) > before
    d.finish_all()
    assert d.outputs["busy"]["tokens"] == expected_output(other, 40)[0]
    assert d.outputs["d"]["tokens"] == expected_output(prompt, 5)[0]
    d.settle()
    p.settle()
    d.assert_no_owned_pages()


def test_request_aborted_before_admission_releases_the_lease(make) -> None:
    p = make("TcpConnector")
    d = make("TcpConnector")
    prompt = prompts(np.random.default_rng(3), [21])[0]
    params = prefill(p, "p", prompt)
    d.add("d", prompt, 5, params)
    d.engine.abort_requests(["d"])  # never scheduled
    d.settle()
    p.run_until(lambda: p.stats().kv_transfer.leases_released == 1, "the release")
    p.settle()
    p.assert_no_owned_pages()
    d.assert_no_owned_pages()


def test_lease_expiry_frees_prefill_pages_and_a_late_read_recomputes(make) -> None:
    p = make("TcpConnector", lease_s=0.2)
    d = make("TcpConnector")
    prompt = prompts(np.random.default_rng(4), [30])[0]
    params = prefill(p, "p", prompt)
    assert p.stats().kv_transfer.held_pages == 8
    p.settle()  # nobody reads: the lease expires
    st = p.stats().kv_transfer
    assert (st.leases_expired, st.held_pages, st.held_requests) == (1, 0, 0)
    p.assert_no_owned_pages()
    d.add("d", prompt, 5, params)
    d.finish_all()
    assert d.outputs["d"]["tokens"] == expected_output(prompt, 5)[0]
    assert d.stats().kv_transfer.loads_failed == 1
    assert d.runner.prefill_tokens("d", len(prompt)) == len(prompt)  # recomputed
    d.settle()
    d.assert_no_owned_pages()


def test_prefill_instance_gone_recompute_or_fail(make) -> None:
    p = make("TcpConnector")
    d = make("TcpConnector")
    d_fail = make("TcpConnector", policy="fail")
    prompt = prompts(np.random.default_rng(5), [26])[0]
    params = prefill(p, "p", prompt)
    p.close()  # its side channel is gone: the loads cannot even be claimed
    d.add("d", prompt, 5, params)
    d.finish_all()
    assert d.outputs["d"]["tokens"] == expected_output(prompt, 5)[0]
    assert d.stats().prompt_tokens_local_compute == len(prompt)
    d_fail.add("d", prompt, 5, params)
    d_fail.finish_all()
    out = d_fail.outputs["d"]
    assert out["finish"] == "abort" and out["error_code"] == "kv_transfer_failed"
    assert "no answer" in out["error"] and out["tokens"] == []
    for inst in (d, d_fail):
        inst.settle()
        inst.assert_no_owned_pages()


def test_incompatible_pair_is_refused_at_handshake(make) -> None:
    p = make("TcpConnector", page_size=4)
    d = make("TcpConnector", page_size=8, policy="fail")
    prompt = prompts(np.random.default_rng(6), [26])[0]
    params = prefill(p, "p", prompt)
    d.add("d", prompt, 5, params)
    d.finish_all()
    out = d.outputs["d"]
    assert out["error_code"] == "kv_transfer_failed"
    assert "incompatible KV: page_size 8 (decode) != 4 (prefill)" in out["error"]
    d.settle()
    d.assert_no_owned_pages()
    # a pair of different connectors is refused too, with the same kind of message
    n = make("NixlConnector", policy="fail")
    n.add("n", prompt, 5, prefill(p, "p2", prompt))
    n.finish_all()
    assert "connector NixlConnector (decode) != TcpConnector (prefill)" in n.outputs["n"]["error"]


def test_offline_params_travel_in_sampling_params_extra_args(make) -> None:
    """vLLM's offline ``LLM.generate`` passes them as ``SamplingParams.extra_args``."""
    p = make("TcpConnector")
    d = make("TcpConnector")
    prompt = prompts(np.random.default_rng(7), [19])[0]

    def add(inst: Instance, rid: str, max_tokens: int, params: dict) -> None:
        inst.engine.add_request(EngineRequest(
            request_id=rid, prompt_token_ids=np.asarray(prompt, dtype=np.int32),
            sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                           ignore_eos=True,
                                           extra_args={"kv_transfer_params": params})))
        inst.outputs[rid] = {"tokens": [], "finish": None, "error": None, "params": None,
                             "error_code": None}

    add(p, "p", 1, {"do_remote_decode": True})
    p.finish_all()
    add(d, "d", 4, p.outputs["p"]["params"])
    d.finish_all()
    assert d.outputs["d"]["tokens"] == expected_output(prompt, 4)[0]
    assert d.runner.prefill_tokens("d", len(prompt)) == 1
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args={"other": 1})


def test_requests_the_engine_cannot_serve_are_rejected(make) -> None:
    consumer = make("TcpConnector", role="kv_consumer")
    with pytest.raises(RequestRejected, match="kv_role is kv_consumer") as e:
        consumer.add("a", [1, 2, 3], 1, {"do_remote_decode": True})
    assert e.value.param == "kv_transfer_params"
    with pytest.raises(RequestRejected, match="remote_block_ids must be"):
        consumer.add("b", [1, 2, 3], 1, {"do_remote_prefill": True, "remote_engine_id": "e",
                                         "remote_request_id": "r", "remote_host": "h",
                                         "remote_port": 1, "remote_block_ids": ["x"]})
    plain = EngineCore(EngineConfig(page_size=4, num_pages=16, max_num_seqs=2),
                       KVChecksumRunner(16, 4, 60))
    with pytest.raises(RequestRejected, match="without --kv-transfer-config"):
        plain.add_request(EngineRequest(request_id="c", prompt_token_ids=np.arange(3, dtype=np.int32),
                                        sampling_params=SamplingParams(),
                                        kv_transfer_params={"do_remote_decode": True}))
    # params asking for nothing change nothing
    plain.add_request(EngineRequest(request_id="d", prompt_token_ids=np.arange(3, dtype=np.int32),
                                    sampling_params=SamplingParams(),
                                    kv_transfer_params={"do_remote_decode": False}))


# ---------------------------------------------------------------------------- parts
def test_parse_kv_transfer_params() -> None:
    router = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert parse_kv_transfer_params(router) == {"do_remote_decode": True,
                                                "do_remote_prefill": False}
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({"remote_host": None}) is None
    full = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
            "remote_block_ids": [3, 4], "remote_host": "127.0.0.1", "remote_port": 5600,
            "router_extra": {"kept": 1}}
    assert parse_kv_transfer_params(full) == full
    for bad, msg in [([], "must be a JSON object"),
                     ({"do_remote_decode": 1}, "do_remote_decode must be bool"),
                     ({"remote_port": True}, "remote_port must be int"),
                     ({**full, "remote_host": None}, "remote_host is required"),
                     ({**full, "remote_block_ids": [-1]}, "page ids >= 0"),
                     ({**full, "remote_port": 0}, r"remote_port=0 must be in \[1, 65535\]"),
                     ({**full, "do_remote_decode": True}, "cannot both be true"),
                     ({"tp_size": 2}, "tp_size=2 is not supported")]:
        with pytest.raises(ValueError, match=msg):
            parse_kv_transfer_params(bad)
    assert kv_transfer_params_from_json("") is None
    assert kv_transfer_params_from_json(kv_transfer_params_to_json(full)) == full
    assert kv_transfer_params_to_json(None) == ""
    with pytest.raises(ValueError, match="^kv_transfer_params_json is not valid JSON"):
        kv_transfer_params_from_json("{")
    with pytest.raises(ValueError, match="^kv_transfer_params_json.remote_port"):
        kv_transfer_params_from_json('{"remote_port": "x"}')


def test_lease_table_with_a_fake_clock() -> None:
    now = [0.0]
    leases = LeaseTable(10.0, clock=lambda: now[0])
    leases.grant("a", [1, 2, 3])
    leases.grant("b", [4])
    assert leases.claim("a", [2, 9]) == BAD_PAGES
    assert leases.check_read("a", [1]) == UNKNOWN  # not claimed yet
    now[0] = 8.0
    assert leases.claim("a", [1, 2]) == OK  # renewed to 18
    assert leases.check_read("a", [1, 2]) == OK
    now[0] = 12.0
    assert leases.take_finished() == {"b"} and leases.expired == 1
    assert leases.claim("b", [4]) == UNKNOWN
    assert leases.finish("a") == OK and leases.finish("a") == UNKNOWN
    assert leases.take_finished() == {"a"} and leases.released == 1 and len(leases) == 0
    leases.grant("c", [5])
    now[0] = 30.0
    assert leases.finish("c") == UNKNOWN  # expired before the decode side was done


def test_kv_transfer_config() -> None:
    c = KVTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_both"}')
    assert c.is_producer and c.is_consumer and len(c.engine_id) == 32
    assert EngineConfig(kv_transfer_config={"kv_connector": "TcpConnector"}).kv_transfer_config \
        .kv_connector == "TcpConnector"
    for bad, msg in [("{", "not valid JSON"), ('{"kv_conector": 1}', "unknown field 'kv_conector'"),
                     ('{"kv_connector": "X"}', "kv_connector='X' is not one of"),
                     ('{"kv_role": "kv_x"}', "kv_role"),
                     ('{"kv_lease_s": 0}', "kv_lease_s"),
                     ('{"kv_load_failure_policy": "retry"}', "kv_load_failure_policy"),
                     ('{"kv_connector_extra_config": {"nope": 1}}', "unknown key 'nope'")]:
        with pytest.raises(ValueError, match=msg):
            KVTransferConfig.parse(bad)


def test_page_runs_merge_pages_consecutive_on_both_sides() -> None:
    local = np.array([10, 11, 12, 5, 30, 31], dtype=np.int32)
    remote = np.array([3, 4, 5, 6, 8, 9], dtype=np.int32)
    lo, re_, n = page_runs(local, remote)
    assert lo.tolist() == [10, 5, 30] and re_.tolist() == [3, 6, 8] and n.tolist() == [3, 1, 2]
    # pages allocated from the free stack come in descending order on both sides: one run
    lo, re_, n = page_runs(np.array([9, 8, 7]), np.array([20, 19, 18]))
    assert lo.tolist() == [7] and re_.tolist() == [18] and n.tolist() == [3]


def test_kv_transfer_params_cross_the_engine_socket_and_fail_as_500() -> None:
    from radixserve.engine_types import (
        ERROR_KV_TRANSFER_FAILED,
        StepOutputs,
        TokenOutput,
    )
    from radixserve.entrypoints.openai.serving_driver import abort_error
    from radixserve.transport.messages import ClientMessage, CoreMessage, decoder, encoder

    params = {"do_remote_prefill": True, "remote_block_ids": [3, 2], "remote_port": 9}
    er = EngineRequest(request_id="r", prompt_token_ids=np.arange(4, dtype=np.int32),
                       sampling_params=SamplingParams(), kv_transfer_params=params)
    enc = encoder()
    assert decoder(ClientMessage).decode(enc.encode(er)).kv_transfer_params == params
    step = StepOutputs(step=1, outputs=[TokenOutput(request_id="r", new_token_ids=[5],
                                                    finish_reason="length",
                                                    kv_transfer_params=params)])
    assert decoder(CoreMessage).decode(enc.encode(step)).outputs[0].kv_transfer_params == params

    class Delta:
        error, error_param, error_code = "could not load", None, ERROR_KV_TRANSFER_FAILED

    err = abort_error(Delta(), "messages")  # type: ignore[arg-type]
    assert err.status_code == 500 and err.code == ERROR_KV_TRANSFER_FAILED


@pytest.mark.parametrize("connector", CONNECTORS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_worker_sides_copy_pages_bit_exactly(connector: str, dtype: torch.dtype) -> None:
    """The worker sides alone (what ``bench pd-transfer`` measures): a lease on the prefill
    side, a read into scattered pages on the decode side, every byte compared."""
    from radixserve.kv_transfer.pull import RecvSpec, RemoteSource

    shape = (2, 12, 4, 3, 8)
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(shape, generator=g).to(dtype) for _ in range(3)]
    dst = [torch.zeros(shape, dtype=dtype) for _ in range(3)]
    workers = []
    try:
        for tensors in (src, dst):
            w = create_worker_connector(KVTransferConfig(kv_connector=connector), "m")
            w.register_kv_caches({str(i): t for i, t in enumerate(tensors)})
            workers.append(w)
        p, d = workers
        remote = np.array([2, 3, 4, 9, 10], dtype=np.int32)
        local = np.array([11, 5, 6, 7, 1], dtype=np.int32)
        p.leases.grant("r", [2, 3, 4, 9, 10, 11])
        src_ = RemoteSource(p.config.engine_id, "r", p.host, p.port, remote)
        assert d.load_blocking(RecvSpec("x", src_, local, remote)) > 0
        for a, b in zip(src, dst, strict=True):
            assert torch.equal(b[:, local], a[:, remote])
            untouched = np.setdiff1d(np.arange(12), local)
            assert not b[:, untouched].any()
        assert p.leases.released == 1 and len(p.leases) == 0
    finally:
        for w in workers:
            w.shutdown()
