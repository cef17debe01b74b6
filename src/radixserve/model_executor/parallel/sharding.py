"""How a decoder's weights split across tensor-parallel ranks (Megatron-LM's layout: Shoeybi et
al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", §3).

* Column-parallel (output rows split, no communication): the fused Q/K/V projection by heads,
  the fused gate/up projection by intermediate columns.
* Row-parallel (input columns split, outputs summed with one all-reduce): ``o_proj`` and
  ``down_proj``.
* Vocab-parallel: embedding rows and LM head rows, the vocabulary padded to a multiple of the
  rank count (an embedding lookup is masked to the rank's rows and all-reduced; the LM head's
  logits are all-gathered).

KV heads follow their query heads. With at least as many KV heads as ranks each rank holds
``num_kv_heads / N`` of them; with fewer (N a multiple of ``num_kv_heads``) each KV head is
replicated on ``N / num_kv_heads`` ranks, as vLLM does. Anything else is refused: a query
head's KV head would live on another rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol


class HeadSizes(Protocol):
    """The sizes ``ShardLayout.for_model`` reads (``models.llama.ModelArgs`` has them)."""

    vocab_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ShardLayout:
    """One rank's share of the model, as half-open ranges into the full model's dimensions.

    Attributes:
        rank, size: this rank and the tensor-parallel size N.
        q_heads: query heads [start, end) of this rank.
        kv_heads: KV heads [start, end) of this rank (replicated ones included).
        intermediate: MLP intermediate columns [start, end).
        vocab: vocabulary rows [start, end) of the padded vocabulary (``padded_vocab`` rows in
            all); rows at or past the real ``vocab_size`` are zero padding.
        padded_vocab: the vocabulary rounded up to a multiple of N.
    """

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    padded_vocab: int

    @classmethod
    def for_model(cls, a: HeadSizes, rank: int, size: int) -> ShardLayout:
        """Rank ``rank``'s share of a model with sizes ``a`` under ``size``-way TP.

        Raises:
            ValueError: ``size`` does not divide the query heads or the intermediate size, or
                neither divides / is a multiple of the KV heads (the message names the sizes
                that would work).
        """
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of tensor_parallel_size {size}")
        problem = _problem(a, size)
        if problem:
            raise ValueError(f"tensor_parallel_size={size} must {problem} (sizes that work for "
                             f"this model: {_working_sizes(a)})")
        nh, nkv = a.num_heads, a.num_kv_heads
        q_per = nh // size
        if nkv >= size:
            kv_per = nkv // size
            kv = (rank * kv_per, (rank + 1) * kv_per)
        else:
            head = rank // (size // nkv)
            kv = (head, head + 1)
        inter = a.intermediate_size // size
        vocab_per = -(-a.vocab_size // size)
        return cls(rank=rank, size=size, q_heads=(rank * q_per, (rank + 1) * q_per),
                   kv_heads=kv, intermediate=(rank * inter, (rank + 1) * inter),
                   vocab=(rank * vocab_per, (rank + 1) * vocab_per),
                   padded_vocab=vocab_per * size)

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def local_args(self, a: HeadSizes) -> HeadSizes:
        """``a`` (a dataclass) with this rank's head counts and intermediate size."""
        return replace(a, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,  # type: ignore[type-var]
                       intermediate_size=self.intermediate_size)


def _problem(a: HeadSizes, size: int) -> str | None:
    """Why ``size``-way TP cannot split ``a``, or None."""
    nh, nkv = a.num_heads, a.num_kv_heads
    if nh % size:
        return f"divide num_attention_heads={nh}"
    if nkv % size and size % nkv:
        return f"divide num_key_value_heads={nkv} or be a multiple of it"
    if a.intermediate_size % size:
        return f"divide intermediate_size={a.intermediate_size}"
    return None


def _working_sizes(a: HeadSizes) -> str:
    return ", ".join(str(n) for n in range(1, a.num_heads + 1) if _problem(a, n) is None)


def single(a: HeadSizes) -> ShardLayout:
    """The layout of an unsharded model (one rank holds everything)."""
    return ShardLayout.for_model(a, 0, 1)
