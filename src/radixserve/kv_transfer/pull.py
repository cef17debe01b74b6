"""The scheduler side both connectors share: pull-based transfers, as vLLM's
``NixlConnectorScheduler`` (the decode instance reads; the prefill instance holds pages).

Prefill role: a request with ``do_remote_decode`` finishes normally (the router asked for one
token); ``request_finished`` grants a lease on its pages and returns the ``kv_transfer_params``
the decode instance needs. Decode role: a request with ``do_remote_prefill`` loads every prompt
token but the last beyond its local prefix hit, asynchronously; the last prompt token is then
computed locally, which samples the first output token (vLLM's decode side recomputes it too:
``Scheduler._update_waiting_for_remote_kv`` sets ``num_computed_tokens = num_tokens - 1``), so
greedy output equals a colocated server's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixserve.config import KVTransferConfig
from radixserve.kv_transfer.base import (
    ConnectorRequest,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
)
from radixserve.kv_transfer.lease import LeaseTable
from radixserve.kv_transfer.params import FIELD, prompt_hash

log = logging.getLogger("radixserve.kv_transfer")


@dataclass
class RemoteSource:
    """Where a prompt's KV lives: the prefill instance's side channel, its request and pages.

    Attributes:
        engine_id / request_id: the prefill instance and its request id (the lease's key).
        host / port: its side channel.
        block_ids: int32 [m] its pages, in prompt order.
    """

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: np.ndarray

    @classmethod
    def of(cls, params: dict[str, Any]) -> RemoteSource:
        return cls(engine_id=params["remote_engine_id"], request_id=params["remote_request_id"],
                   host=params["remote_host"], port=params["remote_port"],
                   block_ids=np.asarray(params["remote_block_ids"], dtype=np.int32))


@dataclass
class RecvSpec:
    """One load for the worker side: read ``remote_pages`` of ``source`` into
    ``local_pages`` (both int32 [n], same order)."""

    request_id: str
    source: RemoteSource
    local_pages: np.ndarray
    remote_pages: np.ndarray


@dataclass
class PullConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker side.

    Attributes:
        reqs_to_recv: loads to start.
        reqs_to_release: leases to end without reading (request finished before loading, or
            its whole prompt was a local prefix hit), as (request id, source).
        reqs_cancelled: requests aborted while loading: skip the read if it has not started.
    """

    reqs_to_recv: list[RecvSpec] = field(default_factory=list)
    reqs_to_release: list[tuple[str, RemoteSource]] = field(default_factory=list)
    reqs_cancelled: set[str] = field(default_factory=set)


class PullConnectorScheduler(KVConnectorScheduler):
    """Scheduler side of ``NixlConnector`` and ``TcpConnector``.

    Args:
        config: the instance's ``KVTransferConfig``.
        page_size: tokens per KV page.
        host / port: this instance's side channel (what ``remote_host`` / ``remote_port``
            tell a decode instance).
        leases: the worker side's lease table (shared in-process: a lease is granted before
            the response leaves, so a decode instance can never claim it too early).
    """

    def __init__(self, config: KVTransferConfig, page_size: int, host: str, port: int,
                 leases: LeaseTable) -> None:
        self.config = config
        self.page_size = page_size
        self.host, self.port = host, port
        self.leases = leases
        self._meta = PullConnectorMetadata()
        #: decode requests whose load runs (until the worker reports them)
        self._loading: set[str] = set()

    # ------------------------------------------------------------------ admission
    def check_request(self, request: ConnectorRequest) -> None:
        p = request.kv_transfer_params
        if not p:
            return
        if p.get("do_remote_decode") and not self.config.is_producer:
            raise ValueError(f"{FIELD}.do_remote_decode: this instance's kv_role is "
                             f"{self.config.kv_role}, it does not prefill for remote decode")
        if p.get("do_remote_prefill") and not self.config.is_consumer:
            raise ValueError(f"{FIELD}.do_remote_prefill: this instance's kv_role is "
                             f"{self.config.kv_role}, it does not decode remote prefills")

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill"):
            return 0, False
        target = request.num_prompt_tokens - 1  # the last prompt token is computed here
        if target <= num_computed_tokens:
            return 0, False
        need = -(-target // self.page_size)
        if len(p["remote_block_ids"]) < need:
            log.warning("request %s: kv_transfer_params has %d remote pages, the prompt needs "
                        "%d: computing the prompt locally", request.request_id,
                        len(p["remote_block_ids"]), need)
            return 0, False
        n, h = p.get("remote_num_tokens"), p.get("remote_prompt_hash")
        if ((n is not None and n != request.num_prompt_tokens)
                or (h is not None and h != prompt_hash(request.prompt_token_ids))):
            log.warning("request %s: the prefill instance computed a different prompt "
                        "(remote_num_tokens, remote_prompt_hash): computing it locally",
                        request.request_id)
            return 0, False
        return target - num_computed_tokens, True

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: np.ndarray,
                                 num_external_tokens: int) -> None:
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill"):
            return
        p["do_remote_prefill"] = False  # one transfer per request, even if preempted later
        source = RemoteSource.of(p)
        rid = request.request_id
        if num_external_tokens == 0:
            self._meta.reqs_to_release.append((rid, source))
            return
        first = (request.num_prompt_tokens - 1 - num_external_tokens) // self.page_size
        local = np.asarray(block_ids, dtype=np.int32).copy()
        remote = source.block_ids[first:first + len(local)]
        self._meta.reqs_to_recv.append(RecvSpec(rid, source, local, remote))
        self._loading.add(rid)

    def build_connector_meta(self) -> PullConnectorMetadata:
        meta, self._meta = self._meta, PullConnectorMetadata()
        return meta

    # ------------------------------------------------------------------ finish
    def request_finished(self, request: ConnectorRequest,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        p = request.kv_transfer_params
        if not p:
            return False, None
        rid = request.request_id
        if rid in self._loading:
            # aborted while its pages are being written: they stay held until the read ended
            self._meta.reqs_cancelled.add(rid)
            return True, None
        if p.get("do_remote_prefill"):
            # finished before it was ever admitted: the prefill instance still holds its pages
            p["do_remote_prefill"] = False
            self._meta.reqs_to_release.append((rid, RemoteSource.of(p)))
            return False, None
        if not p.get("do_remote_decode") or request.finish_reason == "abort" or not block_ids:
            return False, None
        self.leases.grant(rid, block_ids)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id, "remote_request_id": rid,
            "remote_block_ids": list(block_ids), "remote_host": self.host,
            "remote_port": self.port, "tp_size": 1,
            "remote_num_tokens": request.num_prompt_tokens,
            "remote_prompt_hash": prompt_hash(request.prompt_token_ids)}

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._loading -= output.finished_recving

    def has_pending_work(self) -> bool:
        m = self._meta
        return bool(self._loading or m.reqs_to_recv or m.reqs_to_release or m.reqs_cancelled
                    or len(self.leases))
