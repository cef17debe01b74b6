"""The tensor-parallel process group: the collectives a sharded forward needs (all-reduce of
row-parallel outputs, all-gather of vocab-parallel logits) and the broadcast that carries each
step's inputs from rank 0 to the other ranks.

Built on ``torch.distributed`` process-group objects over a ``TCPStore`` on 127.0.0.1, not on
``init_process_group``: the group is an object the runner owns, so an offline ``LLM`` can build,
close and build again in one process, and nothing global is left behind. Gloo carries everything
on CPU; on CUDA, NCCL carries the tensors and Gloo the step messages (CPU bytes), the split vLLM
makes between its device and CPU groups.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

#: Seconds a collective may wait for the slowest rank before it fails (a rank that dies fails
#: the collective at once: its sockets close).
COLLECTIVE_TIMEOUT_S = 300.0


def create_store(size: int, port: int = 0, timeout_s: float = 60.0) -> dist.TCPStore:
    """The rendezvous store: rank 0 (``port`` 0 picks a free port, read it from ``.port``)
    hosts it; other ranks pass that port.

    Raises:
        RuntimeError / DistStoreError: rank 0's store is unreachable within ``timeout_s``.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if port == 0:
        return dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout,
                             wait_for_workers=False)
    return dist.TCPStore("127.0.0.1", port, size, False, timeout=timeout)


class TensorParallelGroup:
    """One rank's handle on the tensor-parallel group.

    Args:
        rank: this rank, 0 runs the scheduler.
        size: ranks in the group (the tensor-parallel size N).
        store: the rendezvous store (``create_store``).
        device: where activations live; "cuda" uses NCCL for tensors.
        timeout_s: seconds a collective may wait.

    Raises:
        RuntimeError: a rank did not join within ``timeout_s``.
    """

    def __init__(self, rank: int, size: int, store: dist.Store, device: torch.device,
                 timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        self.rank = rank
        self.size = size
        timeout = datetime.timedelta(seconds=timeout_s)
        self.cpu = dist.ProcessGroupGloo(dist.PrefixStore("tp-gloo", store), rank, size,
                                         timeout)
        self.device_group: Any = self.cpu
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.device_group = dist.ProcessGroupNCCL(dist.PrefixStore("tp-nccl", store), rank,
                                                      size, opts)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (contiguous, any shape and float dtype) over the ranks, in place; returns
        ``x``."""
        self.device_group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., n] from every rank concatenated in rank order along the last dim:
        [..., N * n] (a new tensor)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.device_group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; two Gloo broadcasts: the length, then the
        bytes). Other ranks pass nothing.

        Raises:
            RuntimeError: a rank died or the collective timed out.
        """
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            header = torch.tensor([len(data)], dtype=torch.int64)
            self.cpu.broadcast(header, 0).wait()
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self.cpu.broadcast(payload, 0).wait()
            return obj
        header = torch.empty(1, dtype=torch.int64)
        self.cpu.broadcast(header, 0).wait()
        payload = torch.empty(int(header[0]), dtype=torch.uint8)
        self.cpu.broadcast(payload, 0).wait()
        return pickle.loads(payload.numpy().tobytes())
