"""``NixlConnector``: the decode instance READs the prefill instance's pages with NIXL (UCX
underneath; DRAM to DRAM on CPU), as vLLM's NixlConnector does.

NIXL's own progress thread busy-polls UCX (a quarter of a core per idle instance, measured), so
it is off: the decode side's load threads progress their reads while they poll them, and the
prefill side drives progress from a thread of its own only while a peer is connecting or a
lease is claimed (a READ needs the target's UCX worker to progress for the connection set-up).

NIXL comes from PyPI (``nixl-cu13``, the ``pd`` extra); ``import nixl_cu13`` alone is enough,
the ``nixl`` meta package is not needed. With ``kv_ip`` on loopback and no
``UCX_NET_DEVICES`` set, UCX is told to use ``lo`` only. UCX's zero-copy path between processes
on one host (CMA) needs both to run as the same user.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from radixserve.config import KVTransferConfig
from radixserve.kv_transfer.pull import RecvSpec
from radixserve.kv_transfer.side_channel import Claim, Hello
from radixserve.kv_transfer.worker import Peer, PullConnectorWorker, TransferError, page_runs

log = logging.getLogger("radixserve.kv_transfer")

#: Seconds between polls of a NIXL transfer's state (and between progress calls).
POLL_S = 0.0002
#: Seconds the prefill side drives progress after a handshake (the peer's connection set-up).
WIREUP_S = 10.0
#: NIXL Python packages, most specific first (``nixl`` is the meta package of both wheels).
NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def load_nixl() -> Any:
    """NIXL's ``_api`` module.

    Raises:
        RuntimeError: no NIXL package is installed (how to get one, or the alternative).
    """
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise RuntimeError("NixlConnector needs NIXL: pip install 'radixserve[pd]' (nixl-cu13), "
                       "or use kv_connector TcpConnector, which needs no NIXL")


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class NixlConnectorWorker(PullConnectorWorker):
    """Worker side of ``NixlConnector``: one NIXL agent named after the engine id, the KV
    tensors registered (DRAM on CPU; VRAM for CUDA tensors, not exercised here: CPU-only CI),
    reads as NIXL READ transfers of page runs.

    Raises:
        RuntimeError: NIXL is not installed.
    """

    connector = "NixlConnector"

    def __init__(self, config: KVTransferConfig, model: str) -> None:
        api = load_nixl()
        super().__init__(config, model)
        if "UCX_NET_DEVICES" not in os.environ and _is_loopback(config.kv_ip):
            os.environ["UCX_NET_DEVICES"] = "lo"
        backends = config.extra("backends", ["UCX"])
        self._agent = api.nixl_agent(config.engine_id, api.nixl_agent_config(
            enable_prog_thread=False, backends=backends))
        # NIXL's agent is driven from the load threads and the progress thread; one at a time
        self._nixl_lock = threading.Lock()
        self._remote_agents: set[str] = set()
        self._wireup_until = 0.0
        self._wake = threading.Event()
        self._stopping = False
        self._progress = threading.Thread(target=self._drive_progress, daemon=True,
                                          name="radixserve-nixl-progress")
        self._progress.start()

    def _on_side_channel(self, msg: object) -> None:
        if isinstance(msg, Hello):
            self._wireup_until = time.monotonic() + WIREUP_S
            self._wake.set()
        elif isinstance(msg, Claim):
            self._wake.set()

    def _drive_progress(self) -> None:
        """Progress UCX (as the prefill side of reads) while a peer connects or reads."""
        while not self._stopping:
            self._wake.wait()
            self._wake.clear()
            while not self._stopping and (time.monotonic() < self._wireup_until
                                          or self.leases.num_claimed()):
                with self._nixl_lock:
                    if self._agent is None:
                        return
                    self._agent.get_new_notifs()  # progresses the UCX worker
                time.sleep(POLL_S)

    def _register_transport(self, kv_caches: list[torch.Tensor]) -> None:
        self._agent.register_memory(kv_caches)

    def _transport_metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def _connect(self, peer: Peer, metadata: bytes) -> Any:
        with self._nixl_lock:
            if peer.engine_id in self._remote_agents:
                self._agent.remove_remote_agent(peer.engine_id)
            try:
                name = self._agent.add_remote_agent(metadata)
            except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
                raise TransferError(f"NIXL could not add agent {peer.engine_id}: {e}") from e
            self._remote_agents.add(name)
        return name

    def _read(self, peer: Peer, spec: RecvSpec) -> None:
        assert self.layout is not None
        local_descs, remote_descs = transfer_descs(self.layout, peer.layout, spec.local_pages,
                                                   spec.remote_pages)
        with self._nixl_lock:
            try:
                handle = self._agent.initialize_xfer(
                    "READ", self._agent.get_xfer_descs(local_descs, self.layout.mem_type),
                    self._agent.get_xfer_descs(remote_descs, peer.layout.mem_type),
                    peer.handle)
                state = self._agent.transfer(handle)
            except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
                raise TransferError(f"NIXL READ from {peer.engine_id} failed to start: {e}") from e
        try:
            while state == "PROC":
                time.sleep(POLL_S)
                with self._nixl_lock:
                    state = self._agent.check_xfer_state(handle)
        finally:
            with self._nixl_lock:
                self._agent.release_xfer_handle(handle)
        if state != "DONE":
            raise TransferError(f"NIXL READ from {peer.engine_id} ended in state {state}")

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._progress.join(timeout=2)
        super().shutdown()
        with self._nixl_lock:
            self._agent = None


def transfer_descs(local: Any, remote: Any, local_pages: np.ndarray,
                   remote_pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NIXL descriptors ``(address, bytes, device id)`` for copying ``remote_pages`` of
    ``remote`` into ``local_pages`` of ``local`` (two ``KVLayout``s): per layer, K then V, one
    descriptor per run of pages consecutive on both sides.

    Returns:
        (local, remote) uint64 [layers * 2 * runs, 3], row i of one matching row i of the other.
    """
    lp, rp, lens = page_runs(np.asarray(local_pages), np.asarray(remote_pages))
    pb = np.uint64(local.page_bytes)
    kv = np.arange(2, dtype=np.uint64)[None, :, None]

    def addrs(layout: Any, first: np.ndarray) -> np.ndarray:
        bases = np.asarray(layout.base_addrs, dtype=np.uint64)[:, None, None]
        off = (kv * np.uint64(layout.num_pages) + first.astype(np.uint64)[None, None, :]) * pb
        return (bases + off).reshape(-1)

    size = np.broadcast_to(lens.astype(np.uint64) * pb, (local.num_layers, 2, len(lens)))
    size = size.reshape(-1)
    return (np.stack([addrs(local, lp), size, np.full_like(size, local.device_id)], axis=1),
            np.stack([addrs(remote, rp), size, np.full_like(size, remote.device_id)], axis=1))
