"""``TcpConnector``: the decode instance reads the prefill instance's pages over the side
channel's ZeroMQ TCP socket. It needs nothing beyond pyzmq, so prefill/decode disaggregation
works where NIXL cannot be installed (one host or several); pages travel as one frame per
layer, copied out of and into the KV pool (about 1.5 GB/s on loopback, NIXL ~8 GB/s).
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.kv_transfer.lease import OK
from radixserve.kv_transfer.pull import RecvSpec
from radixserve.kv_transfer.side_channel import Read, Reply, SideChannelError, call
from radixserve.kv_transfer.worker import Peer, PullConnectorWorker, TransferError

#: Bytes per second a read is assumed to reach at least, for its timeout.
MIN_READ_BYTES_PER_S = 50e6


class TcpConnectorWorker(PullConnectorWorker):
    """Worker side of ``TcpConnector``: serves ``Read`` on the side channel (prefill) and
    writes the received pages into the pool (decode)."""

    connector = "TcpConnector"

    def _register_transport(self, kv_caches: list[torch.Tensor]) -> None:
        pass

    def _transport_metadata(self) -> bytes:
        return b""

    def _connect(self, peer: Peer, metadata: bytes) -> Any:
        return None

    def _serve_read(self, msg: Read) -> tuple[Any, list[Any]]:
        status = self.leases.check_read(msg.request_id, msg.pages)
        if status != OK:
            return Reply(status, "the lease is not held or not claimed"), []
        idx = torch.as_tensor(msg.pages, dtype=torch.long)
        # the pages are held by the lease: no step writes them while they are copied out
        frames = [layer.index_select(1, idx).view(torch.uint8).numpy() for layer in
                  self.kv_caches]
        return Reply(OK), frames

    def _read(self, peer: Peer, spec: RecvSpec) -> None:
        src = spec.source
        layout = peer.layout
        n = len(spec.remote_pages)
        nbytes = n * 2 * layout.num_layers * layout.page_bytes
        timeout = self.timeout_s + nbytes / MIN_READ_BYTES_PER_S
        try:
            reply, frames = call(self._ctx, src.host, src.port,
                                 Read(src.request_id, spec.remote_pages.tolist()), timeout)
        except SideChannelError as e:
            raise TransferError(f"TCP read from {src.host}:{src.port} failed: {e}") from e
        if not isinstance(reply, Reply) or reply.status != OK:
            raise TransferError(f"prefill instance refused the read: "
                                f"{getattr(reply, 'status', reply)}")
        if len(frames) != len(self.kv_caches):
            raise TransferError(f"read returned {len(frames)} layers, expected "
                                f"{len(self.kv_caches)}")
        idx = torch.as_tensor(spec.local_pages, dtype=torch.long)
        for layer, frame in zip(self.kv_caches, frames, strict=True):
            shape = (2, n, *layer.shape[2:])
            data = torch.frombuffer(frame.buffer, dtype=torch.uint8)
            if data.numel() != layer.element_size() * shape[0] * n * layer[0, 0].numel():
                raise TransferError("read returned a layer of the wrong size")
            # the pages belong to the loading request: no step reads or writes them meanwhile
            layer.index_copy_(1, idx, data.view(layer.dtype).view(shape))
