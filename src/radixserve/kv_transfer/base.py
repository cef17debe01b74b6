"""The KV connector API the engine core drives, shaped like vLLM V1's
``KVConnectorBase_V1`` (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``): one object
per role.

Scheduler side (in the scheduler, same thread): ``get_num_new_matched_tokens`` (how many
prompt tokens beyond the local prefix hit can be loaded, and whether asynchronously),
``update_state_after_alloc`` (the pages the load goes into), ``build_connector_meta`` (the
step's work for the worker side), ``request_finished`` (may the pages be freed now; the
``kv_transfer_params`` for the response) and ``update_connector_output``.

Worker side (owns the registered KV tensors): ``register_kv_caches``, ``start_load_kv``,
``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``, ``get_finished`` (requests done
sending / done receiving), ``get_block_ids_with_load_errors``.

Differences from vLLM, because radixserve runs scheduler and model in one process: the
engine core calls the worker side itself, once per step (also in steps with no forward), since
transfers run beside the forward rather than inside it; page ids are numpy int32 arrays; the
request is any object with the ``ConnectorRequest`` attributes, so this package never imports
the core.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch


class ConnectorRequest(Protocol):
    """What a connector reads of an engine request.

    Attributes:
        request_id: the engine's id.
        prompt_token_ids: int32 [P] prompt ids.
        num_prompt_tokens: P.
        kv_transfer_params: the request's parsed params (``params.parse_kv_transfer_params``),
            or None; the connector may update it (vLLM clears ``do_remote_prefill`` once a
            load was set up, so a preempted request does not load twice).
        finish_reason: "stop", "length", "abort" once finished, else None.
    """

    request_id: str
    prompt_token_ids: np.ndarray
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None
    finish_reason: str | None


class KVConnectorMetadata:
    """Scheduler side -> worker side, once per step (vLLM's ``KVConnectorMetadata``); each
    connector subclasses it."""


@dataclass
class KVConnectorOutput:
    """Worker side -> scheduler side after a step (vLLM's ``KVConnectorOutput``).

    Attributes:
        finished_sending: requests whose pages the remote side no longer needs (read and
            confirmed, released, or their lease expired): their held pages can be freed.
        finished_recving: requests whose load ended, successfully or not.
        invalid_block_ids: local pages whose load failed (the requests owning them must not
            use their contents).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


@dataclass
class KVTransferCounters:
    """Cumulative worker-side figures (for ``/metrics``).

    Attributes:
        loads_ok / loads_failed: remote loads that completed / failed (requests).
        pages_read / bytes_read: pages and bytes read from remote instances.
        read_seconds: wall time spent in reads (seconds, summed over reads).
        leases_granted / leases_released / leases_expired: prefill-side leases (requests).
    """

    loads_ok: int = 0
    loads_failed: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    leases_granted: int = 0
    leases_released: int = 0
    leases_expired: int = 0


class KVConnectorScheduler(abc.ABC):
    """Scheduler-side connector (vLLM's scheduler-role methods of ``KVConnectorBase_V1``)."""

    @abc.abstractmethod
    def check_request(self, request: ConnectorRequest) -> None:
        """Refuse a request whose ``kv_transfer_params`` this instance cannot serve (its
        role, its prompt), before it is queued.

        Raises:
            ValueError: naming ``kv_transfer_params``.
        """

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens beyond the ``num_computed_tokens`` of the local prefix hit that can
        be loaded from a remote instance, and whether the load is asynchronous (the request
        then waits in ``WAITING_FOR_REMOTE_KVS`` while others run). (0, False): none."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: np.ndarray,
                                 num_external_tokens: int) -> None:
        """The request got its pages: ``block_ids`` int32 [n] are the local pages the
        ``num_external_tokens`` loaded tokens go into (empty when nothing is loaded)."""

    @abc.abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata:
        """This step's work for the worker side; resets what it handed over."""

    @abc.abstractmethod
    def request_finished(self, request: ConnectorRequest,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request finished (or was aborted), before its pages are freed.

        Args:
            block_ids: the pages that hold its computed prompt, in order.

        Returns:
            (True if the connector keeps the pages until its worker side reports the request
            in ``finished_sending`` / ``finished_recving``, the ``kv_transfer_params`` for the
            response or None).
        """

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the worker side reported this step (default: nothing to track)."""
        return None

    def has_pending_work(self) -> bool:
        """Work the engine must keep stepping for although no request runs (default: none)."""
        return False

    def shutdown(self) -> None:
        """Release resources (default: none)."""
        return None


class KVConnectorWorker(abc.ABC):
    """Worker-side connector (vLLM's worker-role methods of ``KVConnectorBase_V1``)."""

    def __init__(self) -> None:
        self._meta: KVConnectorMetadata | None = None

    def bind_connector_metadata(self, meta: KVConnectorMetadata) -> None:
        """Set this step's metadata (before ``start_load_kv``)."""
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """The KV pool's tensors, one per layer name, each shaped
        ``[2, num_pages, page_size, num_kv_heads, head_dim]`` (``kvcache/storage.py``)."""

    @abc.abstractmethod
    def start_load_kv(self) -> None:
        """Start the loads the bound metadata asks for (asynchronous)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """No layer-wise loading: loads complete before a request is scheduled."""
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, **kwargs: Any) -> None:
        """Pull-based connectors save nothing: the KV stays in the pool until read."""
        return None

    def wait_for_save(self) -> None:
        """Nothing to wait for (see ``save_kv_layer``)."""
        return None

    @abc.abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests done sending, requests done receiving) since the last call."""

    @abc.abstractmethod
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local pages whose load failed since the last call (reported no later than the
        call whose ``get_finished`` reports their request)."""

    def get_load_error_reasons(self) -> dict[str, str]:
        """Why loads failed, by request id, since the last call (radixserve's addition: the
        "fail" policy's error names the cause, e.g. an incompatible pair)."""
        return {}

    def wait_for_activity(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` seconds or until a transfer finished (the engine calls it
        instead of spinning when it has nothing to run but transfers in flight)."""
        return None

    def counters(self) -> KVTransferCounters:
        """Cumulative figures (default: none)."""
        return KVTransferCounters()

    def shutdown(self) -> None:
        """Stop threads and release resources (default: none)."""
        return None
