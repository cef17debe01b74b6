"""Loading in the serving dtype, streamed: parameters made in their dtype, filled a block of
rows at a time from lazily read checkpoint tensors, hold exactly what the float32 load followed
by a cast held (so the same tokens); and a model radixserve cannot serve as meant is refused
from its config.json before any weight is read."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from random_checkpoint import random_checkpoint
from safetensors.torch import save_file

from radixserve.config import EngineConfig
from radixserve.model_executor.loader import (
    ModelFiles,
    checkpoint_weights,
    iter_safetensors,
    lazy_tensor,
)
from radixserve.model_executor.models.llama import CausalLM, ModelArgs, rope_inv_freq
from radixserve.model_executor.parallel.sharding import ShardLayout
from radixserve.model_executor.runner import ModelRunner


def _args(arch: str) -> ModelArgs:
    return ModelArgs(arch=arch, vocab_size=37, hidden_size=32, intermediate_size=24,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                     qkv_bias=arch == "qwen2", qk_norm=False,
                     tie_word_embeddings=arch != "llama", max_position_embeddings=64)


def _write_checkpoint(a: ModelArgs, folder: Path) -> None:
    """A float32 checkpoint in two shards, as Hugging Face lays them out."""
    tensors = random_checkpoint(a)
    names = sorted(tensors)
    half = len(names) // 2
    folder.mkdir()
    for i, part in enumerate((names[:half], names[half:])):
        save_file({k: tensors[k] for k in part}, str(folder / f"model-0000{i + 1}.safetensors"))


def _model(a: ModelArgs, dtype: torch.dtype, shard: ShardLayout | None = None) -> CausalLM:
    inv, scale = rope_inv_freq(None, a.head_dim)
    return CausalLM(a, inv, scale, 64, None, "torch", shard, dtype)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [1, 2])
def test_streamed_load_holds_what_float32_then_cast_held(tmp_path, monkeypatch, arch, tp):
    a = _args(arch)
    folder = tmp_path / "ckpt"
    _write_checkpoint(a, folder)
    # 5 rows per read: blocks cut through the vocabulary and head boundaries
    monkeypatch.setattr(lazy_tensor, "CHUNK_BYTES", 5 * 4 * a.hidden_size)
    for rank in range(tp):
        shard = ShardLayout.for_model(a, rank, tp) if tp > 1 else None
        streamed = _model(a, torch.bfloat16, shard)
        assert all(p.dtype == torch.bfloat16 for p in streamed.parameters())
        files = ModelFiles(folder, str(folder), "ckpt")
        streamed.load_weights(checkpoint_weights(files, a.num_heads, a.num_kv_heads))
        # what the loader did before: float32 parameters, whole tensors, then one cast
        reference = _model(a, torch.float32, shard)
        reference.load_weights(iter_safetensors(folder))
        reference = reference.to(torch.bfloat16)
        ref = dict(reference.named_parameters())
        for name, p in streamed.named_parameters():
            assert torch.equal(p, ref[name]), (rank, name)


def test_lazy_tensors_read_only_their_rows(tmp_path):
    a = _args("llama")
    folder = tmp_path / "ckpt"
    _write_checkpoint(a, folder)
    lazy = dict(checkpoint_weights(ModelFiles(folder, str(folder), "ckpt"), 4, 2))
    full = dict(iter_safetensors(folder))
    t = lazy["model.embed_tokens.weight"]
    assert t.shape == (37, 32)
    assert torch.equal(t.rows(3, 9), full["model.embed_tokens.weight"][3:9])
    assert "model-0000" in t.describe()


def test_shape_mismatch_names_the_tensor(tmp_path):
    a = _args("llama")
    folder = tmp_path / "ckpt"
    _write_checkpoint(a, folder)
    bigger = _args("llama")
    bigger.intermediate_size = 32
    m = _model(bigger, torch.float32)
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight in model-0000"
                                         r"\d\.safetensors' has shape"):
        m.load_weights(checkpoint_weights(ModelFiles(folder, str(folder), "ckpt"), 4, 2))


# ------------------------------------------------------------------------ early refusals

_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 64,
          "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 256, "rope_theta": 10000.0,
          "tie_word_embeddings": True, "hidden_act": "silu"}


def _refused(tmp_path: Path, config: dict, max_model_len: int | None = None) -> str:
    """The error starting a runner on a folder with this config.json and a weight file that
    cannot be read (so an error about the config proves no weight was read first)."""
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"not safetensors: reading it fails")
    with pytest.raises(ValueError) as e:
        ModelRunner(EngineConfig(model=str(folder), dtype="float32", num_pages=64,
                                 max_model_len=max_model_len, attention_backend="torch"))
    return str(e.value)


def test_the_unreadable_weights_are_what_fails_a_good_config(tmp_path):
    assert "not a valid safetensors file" in _refused(tmp_path, _QWEN2)


@pytest.mark.parametrize("change,expect", [
    ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"},
     r"unsupported architecture \['GemmaForCausalLM'\]"),
    ({"quantization_config": {"quant_method": "fp8"}},
     r"quantization_config with quant_method='fp8'"),
    ({"quantization_config": {"quant_method": "awq", "bits": 8, "group_size": 128}},
     r"quantization_config.bits=8"),
    ({"hidden_act": "gelu_pytorch_tanh"}, r"hidden_act='gelu_pytorch_tanh'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_type='dynamic'"),
])
def test_configs_refused_before_weights(tmp_path, change, expect):
    msg = _refused(tmp_path, _QWEN2 | change)
    assert "not a valid safetensors file" not in msg
    assert re.search(expect, msg), msg


def test_sliding_window_shorter_than_the_context_is_refused(tmp_path):
    mistral = _QWEN2 | {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                        "sliding_window": 16, "tie_word_embeddings": False}
    msg = _refused(tmp_path, mistral)
    assert "sliding_window=16 is shorter than max_model_len=256" in msg
    assert "--max-model-len 16" in msg
    # within the window the model is served as trained: the weights are read (and fail here)
    assert "not a valid safetensors file" in _refused(tmp_path, mistral, max_model_len=16)
    # Qwen2 configs carry a window they do not use
    unused = _QWEN2 | {"sliding_window": 16, "use_sliding_window": False}
    assert "not a valid safetensors file" in _refused(tmp_path, unused)
    used = _QWEN2 | {"sliding_window": 16, "use_sliding_window": True}
    assert "sliding_window=16" in _refused(tmp_path, used)


# ------------------------------------------------------------------------ fitting in memory

def test_auto_dtype_falls_back_to_bf16_when_float32_does_not_fit():
    from radixserve.model_executor.memory_fit import fit_dtype, weight_bytes

    # Qwen2.5-7B's sizes: 7.62 B parameters
    a = ModelArgs(arch="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                  num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                  rms_norm_eps=1e-6, qkv_bias=True, qk_norm=False, tie_word_embeddings=False,
                  max_position_embeddings=32768)
    assert weight_bytes(a, torch.bfloat16) == 2 * 7_615_616_512
    cpu, gib = torch.device("cpu"), 1 << 30
    # a 24 GB machine: float32 (28.4 GiB) cannot fit, bfloat16 (14.2 GiB) can
    dtype, why = fit_dtype("auto", torch.float32, a, cpu, available=22 * gib)
    assert dtype == torch.bfloat16 and "float32 weights (28.4 GiB) do not fit" in why
    with pytest.raises(ValueError, match=r"float32 weights need 28\.4 GiB .* try --dtype "
                                         r"bfloat16"):
        fit_dtype("float32", torch.float32, a, cpu, available=22 * gib)
    with pytest.raises(ValueError, match=r"float32 weights need 28\.4 GiB .*quantized GGUF"):
        fit_dtype("auto", torch.float32, a, cpu, available=8 * gib)
    # room enough, or not a CPU: unchanged
    assert fit_dtype("auto", torch.float32, a, cpu, available=64 * gib) == (torch.float32, None)
    assert fit_dtype("auto", torch.float32, a, torch.device("cuda"), available=gib) == (
        torch.float32, None)
    # two tensor-parallel ranks on the machine hold half each
    assert fit_dtype("float32", torch.float32, a, cpu, shards=2, available=22 * gib)[0] == \
        torch.float32
