"""Tensor-parallel weight sharding: the layout of each rank, the refusals, and that the shards
of every checkpoint tensor put back together are the tensor (no process group needed: the
slices are loaded into one ``CausalLM`` per rank in this process)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest
import torch
from random_checkpoint import random_checkpoint

from radixserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from radixserve.model_executor.models.llama import CausalLM, ModelArgs, rope_inv_freq
from radixserve.model_executor.parallel.sharding import ShardLayout


@dataclass
class Sizes:
    vocab_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 64


SMOLLM2 = Sizes(vocab_size=49152, intermediate_size=1536, num_heads=9, num_kv_heads=3)


def test_smollm2_splits_three_ways_one_kv_head_each() -> None:
    shards = [ShardLayout.for_model(SMOLLM2, r, 3) for r in range(3)]
    assert [s.q_heads for s in shards] == [(0, 3), (3, 6), (6, 9)]
    assert [s.kv_heads for s in shards] == [(0, 1), (1, 2), (2, 3)]
    assert [s.intermediate for s in shards] == [(0, 512), (512, 1024), (1024, 1536)]
    assert [s.vocab for s in shards] == [(0, 16384), (16384, 32768), (32768, 49152)]


def test_sizes_that_do_not_divide_are_refused_naming_the_ones_that_work() -> None:
    # SmolLM2: 9 query heads, 3 KV heads, intermediate 1536 -> only 1 and 3
    with pytest.raises(ValueError, match=r"num_attention_heads=9 .*work for this model: 1, 3\)"):
        ShardLayout.for_model(SMOLLM2, 0, 2)
    with pytest.raises(ValueError, match=r"intermediate_size=1536"):
        ShardLayout.for_model(SMOLLM2, 0, 9)
    # 8 query heads over 6 KV heads: 4 ranks neither divide 6 nor are a multiple of it
    with pytest.raises(ValueError, match=r"num_key_value_heads=6 or be a multiple"):
        ShardLayout.for_model(Sizes(100, 96, 12, 6), 0, 4)


def test_fewer_kv_heads_than_ranks_replicates_them() -> None:
    sizes = Sizes(vocab_size=10, intermediate_size=8, num_heads=4, num_kv_heads=2)
    shards = [ShardLayout.for_model(sizes, r, 4) for r in range(4)]
    assert [s.q_heads for s in shards] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # query heads 0, 1 share KV head 0; 2, 3 share KV head 1 (GQA groups of 2)
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # vocabulary 10 padded to 12: 3 rows each, the last rank's last two are padding
    assert shards[0].padded_vocab == 12 and [s.vocab for s in shards][-1] == (9, 12)


def _args(arch: str) -> ModelArgs:
    return ModelArgs(arch=arch, vocab_size=37, hidden_size=32, intermediate_size=24,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                     qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                     tie_word_embeddings=arch != "llama", max_position_embeddings=64)


def _checkpoint(a: ModelArgs) -> dict[str, torch.Tensor]:
    return random_checkpoint(a)


def _load(a: ModelArgs, ckpt: dict[str, torch.Tensor], shard: ShardLayout | None) -> CausalLM:
    inv, scale = rope_inv_freq(argparse.Namespace(rope_parameters=None, rope_theta=10000.0),
                               a.head_dim)
    m = CausalLM(a, inv, scale, 64, None, "torch", shard)
    m.load_weights(ckpt.items())
    return m


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("size", [2, 4])
def test_shards_put_back_together_are_the_whole_model(arch: str, size: int) -> None:
    a = _args(arch)
    ckpt = _checkpoint(a)
    whole = _load(a, ckpt, None)
    shards = [ShardLayout.for_model(a, r, size) for r in range(size)]
    parts = [_load(a, ckpt, s) for s in shards]
    d = a.head_dim
    q, kv = a.num_heads * d, a.num_kv_heads * d
    for i, layer in enumerate(whole.layers):
        ls = [p.layers[i] for p in parts]
        local_q = [s.num_heads * d for s in shards]
        local_kv = [s.num_kv_heads * d for s in shards]
        # Q rows: rank order is head order
        torch.testing.assert_close(
            torch.cat([layer_.qkv[:n] for layer_, n in zip(ls, local_q, strict=True)]),
            layer.qkv[:q], rtol=0, atol=0)
        # K/V rows: each rank holds the KV head its query heads read
        for s, layer_, nq, nkv in zip(shards, ls, local_q, local_kv, strict=True):
            lo, hi = s.kv_heads[0] * d, s.kv_heads[1] * d
            assert torch.equal(layer_.qkv[nq:nq + nkv], layer.qkv[q + lo:q + hi])
            assert torch.equal(layer_.qkv[nq + nkv:], layer.qkv[q + kv + lo:q + kv + hi])
            if a.qkv_bias:
                assert torch.equal(layer_.qkv_bias[nq:nq + nkv], layer.qkv_bias[q + lo:q + hi])
            if a.qk_norm:
                assert torch.equal(layer_.q_norm, layer.q_norm)
        # row-parallel: o and down split by input columns
        assert torch.equal(torch.cat([x.o for x in ls], dim=1), layer.o)
        assert torch.equal(torch.cat([x.down for x in ls], dim=1), layer.down)
        it = a.intermediate_size
        gates = torch.cat([x.gate_up[:x.gate_up.shape[0] // 2] for x in ls])
        ups = torch.cat([x.gate_up[x.gate_up.shape[0] // 2:] for x in ls])
        assert torch.equal(gates, layer.gate_up[:it]) and torch.equal(ups, layer.gate_up[it:])
    # vocab-parallel: rows in rank order, then zero padding up to a multiple of the ranks
    embed = torch.cat([p.embed for p in parts])
    assert embed.shape[0] == shards[0].padded_vocab
    assert torch.equal(embed[:a.vocab_size], whole.embed)
    assert not embed[a.vocab_size:].any()


def test_tensor_parallel_flag_and_vllm_short_spelling() -> None:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["-tp", "2"])).tensor_parallel_size == 2
    assert engine_config_from_args(
        p.parse_args(["--tensor-parallel-size", "3"])).tensor_parallel_size == 3
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be >= 1"):
        engine_config_from_args(p.parse_args(["-tp", "0"]))
    with pytest.raises(ValueError, match="shadow_rate > 0 is not supported"):
        engine_config_from_args(p.parse_args(["-tp", "2", "--shadow-rate", "0.1"]))
