"""Tensor parallelism across sibling processes: ``TensorParallelRunner`` is the engine core's
``StepRunner`` on rank 0; ranks 1..N-1 run ``worker_main`` in processes of their own
(``python -m radixserve.model_executor.parallel.tp_runner``: a fresh interpreter, so a user's
script needs no ``if __name__ == "__main__"`` guard, unlike multiprocessing's spawn).

Each step, rank 0 broadcasts the step's model inputs (the ``ForwardBatch`` without its sampling
state: the seeds' narrow batch-step API), then every rank runs the same forward over its shard,
meeting in the forward's collectives; only rank 0 samples, from the gathered logits. Engine
state (scheduler, radix cache, page tables, grammars, generators) lives on rank 0 alone: the
other ranks hold weights and their KV heads' pages, addressed by the page ids rank 0 chose.

A rank that dies fails the collective it was in, or the next one, on every other rank (its
sockets close): rank 0's ``execute`` then raises ``RankFailure``, which ends the engine the way
any step error does (the server reports it), and the remaining workers exit when their next
broadcast fails.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import replace

import torch
import torch.distributed as dist

from radixserve.config import EngineConfig
from radixserve.engine_types import RunnerStats
from radixserve.model_executor.forward_batch import ALL_GREEDY, ForwardBatch, SampleResult
from radixserve.model_executor.parallel.group import TensorParallelGroup, create_store
from radixserve.model_executor.runner import ModelRunner

log = logging.getLogger(__name__)

#: Seconds rank 0 waits for every worker to load its shard.
LOAD_TIMEOUT_S = 600.0
#: Seconds ``close`` waits for the workers to exit before killing them.
JOIN_TIMEOUT_S = 5.0


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or a collective failed; the engine cannot go on."""


def rank_threads(config: EngineConfig) -> int:
    """torch intra-op threads per rank: ``config.num_threads``, else this process's CPUs split
    evenly over the ranks (at least 1), so N ranks do not oversubscribe the cores."""
    if config.num_threads:
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)


def step_inputs(batch: ForwardBatch) -> ForwardBatch:
    """What the other ranks need of a step: its arrays, without sampling parameters
    (generators, grammar matchers and penalties stay on rank 0, which alone samples)."""
    return replace(batch, sampling=ALL_GREEDY)


def _load_key(rank: int) -> str:
    return f"load/{rank}"


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent (rank 0) dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def worker_main(config: EngineConfig, rank: int, port: int) -> int:
    """A rank r > 0: load its shard, report ``ready <num_pages>`` or ``error <text>`` under
    ``load/<r>`` in the store, join the group, then run every step rank 0 broadcasts until it
    broadcasts None (shutdown: returns 0) or a collective fails (rank 0 gone: returns 1)."""
    torch.set_num_threads(rank_threads(config))
    store = create_store(config.tensor_parallel_size, port)
    try:
        runner = ModelRunner(config, tp_rank=rank)
    except Exception as e:  # noqa: BLE001 - any load failure is reported to rank 0
        store.set(_load_key(rank), f"error {type(e).__name__}: {e}")
        return 1
    store.set(_load_key(rank), f"ready {runner.num_pages}")
    try:
        group = TensorParallelGroup(rank, config.tensor_parallel_size, store, runner.device)
        runner.join_group(group)
        while (batch := group.broadcast_object()) is not None:
            runner.forward_logits(batch)
    except RuntimeError as e:
        log.error("rank %d stops: %s", rank, e)
        return 1
    return 0


def _stop_workers(procs: list[subprocess.Popen], told: bool = False) -> None:
    """Stop the workers: ``told`` (they were sent the shutdown broadcast) waits
    ``JOIN_TIMEOUT_S`` for them to exit; otherwise (a runner never closed, at garbage
    collection or interpreter exit) they get SIGTERM first. Whatever is left is killed."""
    if not told:
        for p in procs:
            if p.poll() is None:
                p.terminate()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class TensorParallelRunner:
    """Rank 0 of ``config.tensor_parallel_size`` ranks, as the engine core's ``StepRunner``.

    Starts ranks 1..N-1 (spawned processes, daemonic: they die with this one), loads shard 0
    here, waits for the others, then joins the group.

    Args:
        config: engine configuration with ``tensor_parallel_size`` N > 1.

    Raises:
        ValueError: the model does not split N ways (names the sizes that would), or any
            load error of rank 0.
        RankFailure: a worker failed to load (its error is in the message) or died.
    """

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        self.size = size
        self._broken: str | None = None
        torch.set_num_threads(rank_threads(config))
        store = create_store(size)
        cfg = json.dumps(dataclasses.asdict(config))
        self._procs = [subprocess.Popen(
            [sys.executable, "-m", "radixserve.model_executor.parallel.tp_runner", "--rank",
             str(rank), "--port", str(store.port), "--config", cfg]) for rank in range(1, size)]
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs)
        try:
            self.local = ModelRunner(config, tp_rank=0)
            self._await_workers(store)
            self.group = TensorParallelGroup(0, size, store, self.local.device)
        except BaseException:
            for p in self._procs:
                p.kill()
            self._finalizer()
            raise
        self.local.join_group(self.group)
        self._store = store  # the other ranks' rendezvous lives as long as the group
        self.num_pages = self.local.num_pages
        self.max_model_len = self.local.max_model_len
        self.info = self.local.info
        self.device = self.local.device
        log.info("tensor parallel: %d ranks (rank 0 here, pids %s)", size,
                 [p.pid for p in self._procs])

    def _await_workers(self, store: dist.Store) -> None:
        """Wait for every worker's load report in the store.

        Raises:
            RankFailure: a worker reported an error, exited, disagrees on the pool size, or
                took longer than ``LOAD_TIMEOUT_S``.
        """
        pending = set(range(1, self.size))
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while pending:
            for rank in sorted(pending):
                proc = self._procs[rank - 1]
                if store.check([_load_key(rank)]):
                    kind, _, value = store.get(_load_key(rank)).decode().partition(" ")
                    if kind == "error":
                        raise RankFailure(f"tensor-parallel rank {rank} failed to load: {value}")
                    if int(value) != self.local.num_pages:
                        raise RankFailure(f"tensor-parallel rank {rank} sized {value} KV pages, "
                                          f"rank 0 {self.local.num_pages}")
                    pending.discard(rank)
                elif proc.poll() is not None:
                    raise RankFailure(f"tensor-parallel rank {rank} exited with code "
                                      f"{proc.returncode} while loading")
            if pending and time.monotonic() > deadline:
                raise RankFailure(f"tensor-parallel ranks {sorted(pending)} did not load "
                                  f"within {LOAD_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def _failure(self, e: BaseException) -> RankFailure:
        time.sleep(0.1)  # a rank that crashed is reaped by now: name it
        dead = [f"rank {r} (exit code {p.poll()})"
                for r, p in enumerate(self._procs, start=1) if p.poll() is not None]
        self._broken = (f"tensor-parallel {', '.join(dead)} died" if dead
                        else f"tensor-parallel collective failed: {e}")
        return RankFailure(self._broken)

    def execute(self, batch: ForwardBatch) -> SampleResult:
        """Broadcast the step's inputs, run shard 0's forward with the others, sample.

        Raises:
            RankFailure: a rank died or a collective failed (now or in an earlier step).
        """
        if self._broken is not None:
            raise RankFailure(self._broken)
        try:
            self.group.broadcast_object(step_inputs(batch))
            return self.local.execute(batch)
        except RuntimeError as e:
            if isinstance(e, RankFailure):
                raise
            raise self._failure(e) from e

    def stats(self) -> RunnerStats:
        """Rank 0's paths and step counts (every rank runs the same paths)."""
        return self.local.stats()

    def close(self) -> None:
        """Tell the workers to exit and wait for them (killed after ``JOIN_TIMEOUT_S``)."""
        told = False
        if self._broken is None and all(p.poll() is None for p in self._procs):
            try:
                self.group.broadcast_object(None)
                told = True
            except RuntimeError as e:
                log.warning("tensor parallel shutdown: %s", e)
        self._broken = self._broken or "closed"
        if self._finalizer.detach() is not None:
            _stop_workers(self._procs, told)


def main(argv: list[str] | None = None) -> int:
    """Entry point of a rank r > 0 (started by ``TensorParallelRunner``)."""
    p = argparse.ArgumentParser(prog="python -m radixserve.model_executor.parallel.tp_runner",
                                description="radixserve tensor-parallel rank (started by rank 0)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True, help="rank 0's rendezvous store port")
    p.add_argument("--config", required=True, help="EngineConfig fields as a JSON object")
    ns = p.parse_args(argv)
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s tp-rank{ns.rank} "
                        "%(name)s: %(message)s")
    return worker_main(EngineConfig(**json.loads(ns.config)), ns.rank, ns.port)


if __name__ == "__main__":
    sys.exit(main())
