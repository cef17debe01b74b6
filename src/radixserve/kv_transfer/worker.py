"""The worker side both connectors share: the side channel (handshake, leases), the decode
side's load jobs, and the figures. How pages move is a subclass's: ``nixl_connector.py`` reads
them with NIXL, ``tcp_connector.py`` over the side channel's socket.

A load job runs in a small thread pool: handshake with the prefill instance (once per
instance: compatibility check, its KV layout), ``Claim`` the lease, read the pages, ``Done``.
Any failure (instance unreachable or killed, lease expired, incompatible pair, transport error)
marks the job's local pages as load errors; the scheduler then recomputes the prompt or fails
the request (``kv_load_failure_policy``). A prefill instance that did not answer is skipped for
``side_channel_timeout_s`` seconds, so a dead instance costs one timeout, not one per request.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

from radixserve.config import KVTransferConfig
from radixserve.kv_transfer.base import KVConnectorWorker, KVTransferCounters
from radixserve.kv_transfer.compat import KVLayout, compat_hash, describe_mismatch
from radixserve.kv_transfer.lease import OK, LeaseTable
from radixserve.kv_transfer.pull import PullConnectorMetadata, RecvSpec, RemoteSource
from radixserve.kv_transfer.side_channel import (
    Claim,
    Done,
    Hello,
    HelloReply,
    Read,
    Release,
    Reply,
    SideChannelError,
    SideChannelServer,
    call,
)

log = logging.getLogger("radixserve.kv_transfer")

#: Load jobs run at once (each mostly waits on the network or the transport).
LOAD_THREADS = 4
#: Default seconds one side-channel call may take.
DEFAULT_SIDE_CHANNEL_TIMEOUT_S = 5.0


class TransferError(RuntimeError):
    """A load cannot complete; the message says why (it reaches the log and, with the "fail"
    policy, the client)."""


@dataclass
class Peer:
    """A prefill instance after a successful handshake.

    Attributes:
        host / port: its side channel; engine_id: its id; layout: its KV pool.
        handle: the transport's handle for it (NIXL: the remote agent's name).
    """

    host: str
    port: int
    engine_id: str
    layout: KVLayout
    handle: Any = None


@dataclass
class LoadJob:
    """One decode-side load in flight.

    Attributes:
        spec: what to read where.
        cancelled: set when the request was aborted: the read is skipped if not started.
        error: why it failed (None: it succeeded or was cancelled).
    """

    spec: RecvSpec
    cancelled: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class PullConnectorWorker(KVConnectorWorker):
    """Worker side of the pull-based connectors.

    Args:
        config: the instance's ``KVTransferConfig``.
        model: the model's name (a compatibility factor).

    Attributes:
        connector: the connector's name, as in ``kv_transfer_config.kv_connector``.
        leases: the prefill side's leases (shared with the scheduler side).
        host / port: the side channel, once ``register_kv_caches`` started it.
        layout: this instance's KV layout, once registered.
    """

    connector = ""

    def __init__(self, config: KVTransferConfig, model: str) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.timeout_s = float(config.extra("side_channel_timeout_s",
                                            DEFAULT_SIDE_CHANNEL_TIMEOUT_S))
        self.load_delay_s = float(config.extra("load_delay_s", 0.0))
        self.leases = LeaseTable(config.kv_lease_s)
        self.layout: KVLayout | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.host, self.port = config.kv_ip, config.kv_port
        self._ctx = zmq.Context()
        self._server: SideChannelServer | None = None
        self._pool = ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="radixserve-kv-load")
        self._lock = threading.Lock()
        self._jobs: dict[str, LoadJob] = {}
        self._done_recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._error_reasons: dict[str, str] = {}
        self._peers: dict[tuple[str, int, str], Peer] = {}
        self._peer_lock = threading.Lock()
        self._unreachable: dict[tuple[str, int], float] = {}
        self._activity = self.leases.changed  # set by lease ends and by finished loads
        self._counters = KVTransferCounters()
        self._factors: dict[str, object] = {}

    # ------------------------------------------------------------------ set-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the pool's tensors with the transport and start the side channel.

        Raises:
            ValueError: tensors not shaped like ``kvcache/storage.py``'s.
            zmq.ZMQError: ``kv_ip``/``kv_port`` cannot be bound.
        """
        tensors = list(kv_caches.values())
        self.layout = KVLayout.of(self.model, tensors)
        self.kv_caches = tensors
        self._factors = self.layout.factors()
        self._register_transport(tensors)
        self._server = SideChannelServer(self._ctx, self.config.kv_ip, self.config.kv_port,
                                         self._handle)
        self.host, self.port = self._server.host, self._server.port
        log.info("%s: engine %s, side channel %s:%d, %d KV tensors of %d pages",
                 self.connector, self.config.engine_id, self.host, self.port, len(tensors),
                 self.layout.num_pages)

    @abc.abstractmethod
    def _register_transport(self, kv_caches: list[torch.Tensor]) -> None:
        """Make the tensors readable by peers (NIXL: register the memory)."""

    @abc.abstractmethod
    def _transport_metadata(self) -> bytes:
        """What a peer needs to read from this instance (sent in the handshake)."""

    @abc.abstractmethod
    def _connect(self, peer: Peer, metadata: bytes) -> Any:
        """Prepare reads from ``peer`` (given its handshake metadata); returns its handle.

        Raises:
            TransferError: the transport cannot reach it.
        """

    @abc.abstractmethod
    def _read(self, peer: Peer, spec: RecvSpec) -> None:
        """Copy ``spec.remote_pages`` of ``peer`` into ``spec.local_pages`` (blocking).

        Raises:
            TransferError / SideChannelError: the read failed.
        """

    def _serve_read(self, msg: Read) -> tuple[Any, list[Any]]:
        """Answer a ``Read`` (only the TCP connector reads over the side channel)."""
        return Reply("error", f"{self.connector} does not serve reads on the side channel"), []

    # ------------------------------------------------------------------ prefill side
    def _handle(self, msg: Any) -> tuple[Any, list[Any]]:
        """The side channel's requests (runs on its thread)."""
        out = self._answer(msg)
        self._on_side_channel(msg)
        return out

    def _on_side_channel(self, msg: Any) -> None:
        """Called after each side-channel request was answered (the NIXL connector starts
        driving its transport's progress when a peer connects or claims a lease)."""

    def _answer(self, msg: Any) -> tuple[Any, list[Any]]:
        if isinstance(msg, Hello):
            theirs = msg.factors
            if msg.connector != self.connector or compat_hash(theirs) != compat_hash(
                    self._factors):
                why = describe_mismatch(theirs, self._factors, "decode", "prefill")
                if msg.connector != self.connector:
                    why = f"connector {msg.connector} (decode) != {self.connector} (prefill)"
                log.warning("%s: refused a handshake from an incompatible instance: %s",
                            self.connector, why)
                return HelloReply(ok=False, reason=f"incompatible KV: {why}",
                                  factors=self._factors), []
            return HelloReply(ok=True, engine_id=self.config.engine_id, factors=self._factors,
                              layout=self.layout, transport=self._transport_metadata()), []
        if isinstance(msg, Claim):
            return Reply(self.leases.claim(msg.request_id, msg.pages)), []
        if isinstance(msg, Done | Release):
            return Reply(self.leases.finish(msg.request_id)), []
        if isinstance(msg, Read):
            return self._serve_read(msg)
        return Reply("error", f"unexpected message {type(msg).__name__}"), []

    # ------------------------------------------------------------------ decode side
    def start_load_kv(self) -> None:
        meta = self._meta
        if not isinstance(meta, PullConnectorMetadata):
            return
        for rid in meta.reqs_cancelled:
            job = self._jobs.get(rid)
            if job is not None:
                job.cancelled.set()
        for spec in meta.reqs_to_recv:
            job = LoadJob(spec)
            self._jobs[spec.request_id] = job
            self._pool.submit(self._run_load, job)
        for rid, source in meta.reqs_to_release:
            self._pool.submit(self._release_remote, rid, source)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending = self.leases.take_finished()
        with self._lock:
            recving, self._done_recving = self._done_recving, set()
        for rid in recving:
            self._jobs.pop(rid, None)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def get_load_error_reasons(self) -> dict[str, str]:
        with self._lock:
            out, self._error_reasons = self._error_reasons, {}
        return out

    def wait_for_activity(self, timeout_s: float) -> None:
        if self._activity.wait(timeout_s):
            self._activity.clear()

    def _run_load(self, job: LoadJob) -> None:
        spec = job.spec
        src = spec.source
        claimed = False
        t0 = time.perf_counter()
        try:
            if self.load_delay_s:
                job.cancelled.wait(self.load_delay_s)
            peer = self._peer(src)
            if job.cancelled.is_set():
                self._release_remote(spec.request_id, src)
                return
            pages = spec.remote_pages.tolist()
            reply = self._call(src, Claim(src.request_id, pages))
            if reply.status != OK:
                raise TransferError(f"prefill instance {src.engine_id} refused the read of "
                                    f"request {src.request_id}: lease {reply.status} "
                                    f"(expired after kv_lease_s, or already read)")
            claimed = True
            if job.cancelled.is_set():
                self._release_remote(spec.request_id, src)
                return
            t0 = time.perf_counter()
            self._read(peer, spec)
            elapsed = time.perf_counter() - t0
            reply = self._call(src, Done(src.request_id))
            if reply.status != OK:
                raise TransferError(f"the lease of request {src.request_id} on prefill "
                                    f"instance {src.engine_id} ended during the read")
            n = len(spec.local_pages)
            assert peer.layout is not None
            with self._lock:
                c = self._counters
                c.loads_ok += 1
                c.pages_read += n
                c.bytes_read += n * 2 * peer.layout.num_layers * peer.layout.page_bytes
                c.read_seconds += elapsed
        except (TransferError, SideChannelError, OSError, zmq.ZMQError) as e:
            job.error = str(e)
            log.warning("request %s: loading %d pages from %s:%d failed after %.3f s: %s",
                        spec.request_id, len(spec.local_pages), src.host, src.port,
                        time.perf_counter() - t0, e)
            if claimed or not isinstance(e, SideChannelError):
                self._release_remote(spec.request_id, src)
        except Exception as e:  # noqa: BLE001 - a bug here must fail the load, not hang it
            job.error = f"{type(e).__name__}: {e}"
            log.exception("request %s: load failed", spec.request_id)
        finally:
            with self._lock:
                if job.error is not None:
                    self._counters.loads_failed += 1
                    self._load_errors.update(spec.local_pages.tolist())
                    self._error_reasons[spec.request_id] = job.error
                self._done_recving.add(spec.request_id)
            self._activity.set()

    def load_blocking(self, spec: RecvSpec) -> float:
        """Run one load in the calling thread, as a load job does (handshake if needed,
        ``Claim``, read, ``Done``), without the scheduler: for benchmarks and tools.

        Returns:
            seconds the read itself took.

        Raises:
            TransferError / SideChannelError: as a load job would fail.
        """
        src = spec.source
        peer = self._peer(src)
        reply = self._call(src, Claim(src.request_id, spec.remote_pages.tolist()))
        if reply.status != OK:
            raise TransferError(f"lease of {src.request_id}: {reply.status}")
        t0 = time.perf_counter()
        self._read(peer, spec)
        elapsed = time.perf_counter() - t0
        if self._call(src, Done(src.request_id)).status != OK:
            raise TransferError(f"the lease of {src.request_id} ended during the read")
        return elapsed

    def _release_remote(self, request_id: str, src: RemoteSource) -> None:
        """End ``src``'s lease without (more) reading; best effort (it expires anyway)."""
        try:
            self._call(src, Release(src.request_id))
        except (SideChannelError, TransferError, zmq.ZMQError) as e:
            log.info("request %s: could not release the lease of %s on %s:%d (%s); it "
                     "expires after kv_lease_s", request_id, src.request_id, src.host,
                     src.port, e)

    def _call(self, src: RemoteSource, msg: Any) -> Any:
        """A side-channel call to ``src``'s instance; fails at once while it is marked
        unreachable."""
        key = (src.host, src.port)
        until = self._unreachable.get(key)
        if until is not None and time.monotonic() < until:
            raise TransferError(f"prefill instance {src.host}:{src.port} did not answer "
                                f"recently; not trying again for {until - time.monotonic():.1f} s")
        try:
            reply, _ = call(self._ctx, src.host, src.port, msg, self.timeout_s)
        except SideChannelError:
            self._unreachable[key] = time.monotonic() + self.timeout_s
            raise
        self._unreachable.pop(key, None)
        return reply

    def _peer(self, src: RemoteSource) -> Peer:
        """The handshaken peer for ``src`` (handshake on first use).

        Raises:
            TransferError: incompatible, another instance now listens there, or unreachable.
        """
        key = (src.host, src.port, src.engine_id)
        with self._peer_lock:
            peer = self._peers.get(key)
            if peer is not None:
                return peer
            reply = self._call(src, Hello(self._factors, self.connector))
            if not isinstance(reply, HelloReply):
                raise TransferError(f"bad handshake answer from {src.host}:{src.port}")
            if not reply.ok:
                raise TransferError(f"prefill instance {src.host}:{src.port} refused the "
                                    f"handshake: {reply.reason}")
            why = describe_mismatch(self._factors, reply.factors, "decode", "prefill")
            if why:
                raise TransferError(f"incompatible KV: {why}")
            if reply.engine_id != src.engine_id:
                raise TransferError(f"{src.host}:{src.port} is engine {reply.engine_id}, not "
                                    f"{src.engine_id} (restarted?)")
            assert reply.layout is not None
            peer = Peer(src.host, src.port, reply.engine_id, reply.layout)
            peer.handle = self._connect(peer, reply.transport)
            self._peers[key] = peer
            log.info("%s: handshake with engine %s at %s:%d", self.connector, peer.engine_id,
                     peer.host, peer.port)
            return peer

    # ------------------------------------------------------------------ figures, life
    def counters(self) -> KVTransferCounters:
        with self._lock:
            c = KVTransferCounters(**self._counters.__dict__)
        c.leases_granted = self.leases.granted
        c.leases_released = self.leases.released
        c.leases_expired = self.leases.expired
        return c

    def shutdown(self) -> None:
        for job in list(self._jobs.values()):
            job.cancelled.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._server is not None:
            self._server.close()
            self._server = None
        self._ctx.term()


def page_runs(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                              np.ndarray]:
    """Merge page pairs into runs that are consecutive on both sides (fewer, longer copies).

    Args:
        local / remote: int32 [n] page pairs (local[i] receives remote[i]).

    Returns:
        (local first pages, remote first pages, run lengths), int64 [r] each.
    """
    order = np.argsort(remote, kind="stable")
    r = remote[order].astype(np.int64)
    loc = local[order].astype(np.int64)
    n = len(r)
    if n == 0:
        e = np.empty(0, np.int64)
        return e, e, e
    starts = np.ones(n, dtype=bool)
    starts[1:] = (np.diff(r) != 1) | (np.diff(loc) != 1)
    idx = np.flatnonzero(starts)
    lens = np.diff(np.append(idx, n))
    return loc[idx], r[idx], lens
