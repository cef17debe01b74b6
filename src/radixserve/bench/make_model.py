"""``radixserve bench make-model``: a random-weight model with the exact layer shapes of a real
one, so that benchmarks measure real-size models without downloading anything.

The weights are random (seeded), so **the text such a model produces is gibberish; its speed is
real**: every matmul, KV-cache page and logits row has the size the real model's has. The folder
is a Hugging Face folder that radixserve, transformers and vLLM load like the real one:

* ``config.json``: the real model's values (:data:`SHAPES`), except ``bos/eos/pad_token_id``,
  which are the default model's tokenizer's (its tokenizer files ship in the folder), plus a
  ``radixserve_random_model`` entry saying the weights are random;
* ``model-0000K-of-0000N.safetensors`` (bfloat16, shards of at most :data:`SHARD_BYTES`) and
  ``model.safetensors.index.json`` (Hugging Face's layout: ``{"metadata": {"total_size":
  bytes}, "weight_map": {tensor name: file}}``);
* the default model's (SmolLM2-135M-Instruct's) tokenizer files, copied from its converted
  folder: 49152 tokens, fewer than the real vocabularies, as real Qwen checkpoints also have more
  embedding rows than tokenizer entries;
* ``generation_config.json`` (the tokenizer's bos/eos/pad ids);
* ``radixserve-random-model.json``: shape name, seed, overrides, tensor count and bytes.

With ``gguf`` it also writes ``<shape>-<type>.gguf`` into the folder, holding the same values:
BF16 and F32 exactly, Q8_0 / Q4_0 / Q4_1 quantized by gguf-py (``gguf.quants.quantize``: every
2-D weight, token embedding and output included, like ``llama-quantize --pure``), and Q4_K_M /
Q5_K_M / Q6_K by llama.cpp's own quantizer (``llama_model_quantize`` of llama-cpp-python, run
with the peers venv's Python, ``make bench-peers``) from a temporary BF16 GGUF. Names, metadata,
the llama3 ``rope_freqs`` tensor and the llama q/k row permutation are those of llama.cpp's
``convert_hf_to_gguf.py``; the tokenizer metadata is the default model's GGUF's (that of the
tokenizer's own GGUF where another tokenizer is given), its token list padded to the model's
vocabulary with ``[PAD<i>]`` tokens of type UNUSED, as that converter pads.

Memory: one tensor is generated at a time (in float32 chunks of :data:`_CHUNK` elements) and
one safetensors shard is held until it is written, so the peak is about one shard (2 GB) plus
the largest tensor, whatever the model's size (a 7B model is 15 GB of bfloat16). The GGUF is
written one tensor at a time from the shards (peak: the largest tensor in float32).

Everything is built in a temporary folder next to ``out`` and renamed into place at the end, so
``out`` never holds a half-written model; a failure removes the temporary folder.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import subprocess
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

#: largest safetensors shard, bytes (Hugging Face's ``max_shard_size`` style: a shard may hold
#: one larger tensor alone)
SHARD_BYTES = 2 * 10**9
MARKER_FILE = "radixserve-random-model.json"
#: tokenizer files copied from the default model's converted folder (when present there)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
#: GGUF types written by gguf-py in this process
GGUF_PY_TYPES = ("BF16", "F32", "Q8_0", "Q4_0", "Q4_1")
#: GGUF types written by llama.cpp's quantizer (llama-cpp-python in the peers venv)
LLAMA_CPP_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K")
GGUF_TYPES = GGUF_PY_TYPES + LLAMA_CPP_TYPES
NOTE = "random weights: the text this model generates is gibberish; its speed is real"

_CHUNK = 1 << 24  # elements generated (float32) or quantized per step: 64 MB of float32
_BIAS_STD = 0.1
_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelShape:
    """The layer shapes and config values of one real model.

    Attributes:
        name: the ``--shape`` name.
        source: the Hugging Face repository whose config.json these values are.
        architecture: the transformers class (``Qwen2ForCausalLM``, ``LlamaForCausalLM``).
        model_type: ``qwen2`` or ``llama`` (also the GGUF architecture).
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
            num_key_value_heads, vocab_size, max_position_embeddings: as in config.json.
        head_dim: written to config.json only where the real one has it (else
            hidden_size // num_attention_heads).
        tie_word_embeddings: no ``lm_head.weight`` when True.
        rope_theta, rms_norm_eps: as in config.json.
        rope_scaling: config.json's ``rope_scaling`` (llama3) or None.
        qkv_bias: q/k/v projections have biases (Qwen2).
        extra: further config.json keys of the real model.
    """

    name: str
    source: str
    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    head_dim: int | None = None
    rope_scaling: dict[str, Any] | None = None
    qkv_bias: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def dim_per_head(self) -> int:
        """Attention head width: ``head_dim`` or ``hidden_size // num_attention_heads``."""
        return self.head_dim or self.hidden_size // self.num_attention_heads


def _qwen25(name: str, source: str, hidden: int, inter: int, layers: int, heads: int,
            kv_heads: int, vocab: int, tied: bool, window_layers: int,
            sliding_window: int) -> ModelShape:
    return ModelShape(
        name=name, source=source, architecture="Qwen2ForCausalLM", model_type="qwen2",
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        tie_word_embeddings=tied, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768, qkv_bias=True,
        extra={"use_sliding_window": False, "sliding_window": sliding_window,
               "max_window_layers": window_layers, "attention_dropout": 0.0,
               "hidden_act": "silu", "initializer_range": 0.02, "use_cache": True})


def _llama3(name: str, source: str, hidden: int, inter: int, layers: int, heads: int,
            kv_heads: int, tied: bool, factor: float, head_dim: int | None) -> ModelShape:
    return ModelShape(
        name=name, source=source, architecture="LlamaForCausalLM", model_type="llama",
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=128256,
        tie_word_embeddings=tied, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=131072, head_dim=head_dim,
        rope_scaling={**_LLAMA3_ROPE, "factor": factor},
        extra={"attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
               "hidden_act": "silu", "initializer_range": 0.02, "pretraining_tp": 1,
               "use_cache": True})


#: ``--shape`` name -> the real model's config values (from the Instruct models' config.json)
SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    _qwen25("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", 896, 4864, 24, 14, 2, 151936,
            tied=True, window_layers=21, sliding_window=32768),
    _qwen25("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B-Instruct", 1536, 8960, 28, 12, 2, 151936,
            tied=True, window_layers=21, sliding_window=32768),
    _qwen25("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", 3584, 18944, 28, 28, 4, 152064,
            tied=False, window_layers=28, sliding_window=131072),
    _llama3("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", 2048, 8192, 16, 32, 8,
            tied=True, factor=32.0, head_dim=64),
    _llama3("llama-3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", 4096, 14336, 32, 32, 8,
            tied=False, factor=8.0, head_dim=None),
)}


@dataclass(frozen=True)
class TensorSpec:
    """One weight: Hugging Face name, torch shape, how it is initialised.

    Attributes:
        name: e.g. ``model.layers.0.self_attn.q_proj.weight``.
        shape: ``(rows, columns)`` for matrices (``(out_features, in_features)``), ``(n,)``.
        init: ``"ones"`` (RMSNorm weights) or ``"normal"``.
        std: standard deviation of a ``"normal"`` tensor: ``1/sqrt(in_features)`` for linear
            weights and the embedding (activations keep unit scale through any depth),
            :data:`_BIAS_STD` for biases.
    """

    name: str
    shape: tuple[int, ...]
    init: str
    std: float = 0.0

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass
class MadeModel:
    """What :func:`make_model` wrote.

    Attributes:
        folder: the Hugging Face folder (``out``).
        gguf: the GGUF file in it, or None.
        shape: the shape name.
        num_parameters: elements of all weights (the real model's count when no override).
        safetensors_bytes: bytes of tensor data in the shards (2 per parameter).
        num_shards: safetensors files.
        gguf_bytes: size of the GGUF file, or None.
        seconds: wall time of the whole call.
    """

    folder: Path
    gguf: Path | None
    shape: str
    num_parameters: int
    safetensors_bytes: int
    num_shards: int
    gguf_bytes: int | None
    seconds: float


# ---------------------------------------------------------------------------------- the plan
def resolve_shape(name: str, num_layers: int | None = None,
                  vocab_size: int | None = None) -> ModelShape:
    """The :data:`SHAPES` entry ``name`` with the layer count and vocabulary overridden.

    Raises:
        ValueError: unknown shape (the message lists the known ones), or an override < 1.
    """
    from dataclasses import replace

    shape = SHAPES.get(name)
    if shape is None:
        raise ValueError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}")
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"--num-layers must be at least 1, got {num_layers}")
        shape = replace(shape, num_hidden_layers=num_layers)
    if vocab_size is not None:
        if vocab_size < 1:
            raise ValueError(f"--vocab-size must be at least 1, got {vocab_size}")
        shape = replace(shape, vocab_size=vocab_size)
    return shape


def tensor_specs(shape: ModelShape) -> list[TensorSpec]:
    """Every weight of ``shape`` under its Hugging Face name, in the order they are written.

    Qwen2 has q/k/v biases; ``lm_head.weight`` only when the embeddings are not tied.
    """
    h, inter, d = shape.hidden_size, shape.intermediate_size, shape.dim_per_head
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d

    def linear(name: str, out_f: int, in_f: int) -> TensorSpec:
        return TensorSpec(name, (out_f, in_f), "normal", 1.0 / math.sqrt(in_f))

    specs = [TensorSpec("model.embed_tokens.weight", (shape.vocab_size, h), "normal",
                        1.0 / math.sqrt(h))]
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        specs.append(TensorSpec(p + "input_layernorm.weight", (h,), "ones"))
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            specs.append(linear(f"{p}self_attn.{proj}.weight", rows, h))
            if shape.qkv_bias:
                specs.append(TensorSpec(f"{p}self_attn.{proj}.bias", (rows,), "normal",
                                        _BIAS_STD))
        specs.append(linear(p + "self_attn.o_proj.weight", h, q))
        specs.append(TensorSpec(p + "post_attention_layernorm.weight", (h,), "ones"))
        specs.append(linear(p + "mlp.gate_proj.weight", inter, h))
        specs.append(linear(p + "mlp.up_proj.weight", inter, h))
        specs.append(linear(p + "mlp.down_proj.weight", h, inter))
    specs.append(TensorSpec("model.norm.weight", (h,), "ones"))
    if not shape.tie_word_embeddings:
        specs.append(linear("lm_head.weight", shape.vocab_size, h))
    return specs


def plan_shards(specs: list[TensorSpec], max_bytes: int = SHARD_BYTES,
                itemsize: int = 2) -> list[list[TensorSpec]]:
    """Split ``specs`` (in order) into shards of at most ``max_bytes`` of tensor data each; a
    tensor larger than that gets a shard of its own."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def config_dict(shape: ModelShape, seed: int, overrides: dict[str, int],
                token_ids: dict[str, int | None]) -> dict[str, Any]:
    """``config.json`` of ``shape``: the real model's keys and values (with the overrides
    applied), the tokenizer's special-token ids, and the ``radixserve_random_model`` note."""
    cfg: dict[str, Any] = {
        "architectures": [shape.architecture],
        "model_type": shape.model_type,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        **shape.extra,
        **{k: v for k, v in token_ids.items() if v is not None},
        "radixserve_random_model": {"shape": shape.name, "like": shape.source, "seed": seed,
                                    "overrides": overrides, "note": NOTE},
    }
    if shape.head_dim is not None:
        cfg["head_dim"] = shape.head_dim
    if shape.rope_scaling is not None:
        cfg["rope_scaling"] = dict(shape.rope_scaling)
    return dict(sorted(cfg.items()))


# ------------------------------------------------------------------------------- generation
def _tensor_seed(seed: int, name: str) -> int:
    """A per-tensor seed: the same tensor name and ``seed`` give the same values whatever the
    layer count, vocabulary or shard layout."""
    return ((seed * 0x9E3779B97F4A7C15) ^ zlib.crc32(name.encode())) & (2**63 - 1)


def generate_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The bfloat16 values of ``spec``, drawn from a ``torch.Generator`` seeded by
    :func:`_tensor_seed`, :data:`_CHUNK` float32 elements at a time (so the float32 draw never
    needs the whole tensor's 4 bytes per element)."""
    import torch

    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(_tensor_seed(seed, spec.name))
    out = torch.empty(spec.shape, dtype=torch.bfloat16)
    flat = out.view(-1)
    for start in range(0, spec.numel, _CHUNK):
        n = min(_CHUNK, spec.numel - start)
        chunk = torch.randn(n, generator=gen, dtype=torch.float32)
        flat[start:start + n].copy_(chunk.mul_(spec.std))
    return out


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_safetensors(folder: Path, specs: list[TensorSpec], seed: int,
                      max_bytes: int = SHARD_BYTES,
                      log: Callable[[str], None] | None = None) -> tuple[int, int]:
    """Generate every tensor and write the shards and ``model.safetensors.index.json``.

    Returns:
        ``(tensor bytes, number of shards)``.

    Raises:
        OSError: the folder cannot be written (e.g. disk full).
    """
    from safetensors.torch import save_file

    shards = plan_shards(specs, max_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        name = _shard_name(i, len(shards))
        tensors = {spec.name: generate_tensor(spec, seed) for spec in shard}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        total += nbytes
        weight_map.update({spec.name: name for spec in shard})
        if log:
            log(f"wrote {name} ({nbytes / 1e9:.2f} GB, {len(shard)} tensors)")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total, len(shards)


def iter_folder_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every weight in the folder's shards, one tensor in memory at a time,
    in index order (shard by shard)."""
    from safetensors import safe_open

    index = json.loads((Path(folder) / "model.safetensors.index.json").read_text())
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(Path(folder) / file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


# -------------------------------------------------------------------------------- tokenizer
def _default_tokenizer_folder() -> Path:
    from radixserve.model_executor.loader import resolve_model

    return resolve_model(None).folder


def _copy_tokenizer(src: Path, out: Path, max_len: int) -> tuple[dict[str, int | None], int]:
    """Copy the tokenizer files of ``src`` into ``out`` (``model_max_length`` set to the
    shape's context). Returns the special-token ids (``bos/eos/pad_token_id``, from ``src``'s
    generation_config.json, else its config.json) and the tokenizer's size (added tokens
    included).

    Raises:
        ValueError: ``src`` has no tokenizer.json or no eos id.
    """
    from tokenizers import Tokenizer

    if not (src / "tokenizer.json").is_file():
        raise ValueError(f"tokenizer folder {src} has no tokenizer.json")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    tc_path = out / "tokenizer_config.json"
    if tc_path.is_file():
        tc = json.loads(tc_path.read_text())
        tc["model_max_length"] = max_len
        tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    ids: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None,
                                  "pad_token_id": None}
    for name in ("generation_config.json", "config.json"):
        path = src / name
        if path.is_file():
            data = json.loads(path.read_text())
            for key in ids:
                if ids[key] is None and isinstance(data.get(key), int):
                    ids[key] = data[key]
    if ids["eos_token_id"] is None:
        raise ValueError(f"tokenizer folder {src} names no eos_token_id in its "
                         "generation_config.json or config.json")
    size = Tokenizer.from_file(str(src / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    return ids, size


# ------------------------------------------------------------------------------------- GGUF
def _gguf_name(spec_name: str) -> str:
    """llama.cpp's name of a Hugging Face weight (``gguf.constants.TENSOR_NAMES``)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if spec_name in top:
        return top[spec_name]
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    _, _, i, rest = spec_name.split(".", 3)  # model.layers.<i>.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{layer[module]}.{kind}"


def llama3_rope_factors(shape: ModelShape) -> list[float]:
    """llama.cpp's ``rope_freqs.weight`` for llama3 RoPE scaling: one factor per frequency
    pair, computed as ``convert_hf_to_gguf.py`` (``LlamaModel.generate_extra_tensors``) does."""
    import torch

    assert shape.rope_scaling is not None
    rs, dim, base = shape.rope_scaling, shape.dim_per_head, shape.rope_theta
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    out: list[float] = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(float(factor))
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` of q_proj / k_proj rows (``n_head``: query heads for
    q, KV heads for k), so that its RoPE rotates adjacent pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@functools.lru_cache(maxsize=2)
def _read_tokenizer_fields(path: str, size: int, mtime_ns: int
                           ) -> tuple[tuple[str, Any, Any, Any], ...]:
    """The tokenizer fields of a GGUF as ``(key, value, GGUFValueType, array sub-type)``, read
    once per process and file version (gguf-py's reader takes seconds on a 49k-token list)."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    out = []
    for key, f in reader.fields.items():
        if key.startswith("tokenizer.ggml.") or key == "tokenizer.chat_template":
            vtype = f.types[0]
            sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
            out.append((key, f.contents(), vtype, sub))
    return tuple(out)


def _tokenizer_fields(tokenizer_gguf: Path, vocab_size: int) -> list[tuple[str, Any, Any, Any]]:
    """``(key, value, GGUFValueType, array sub-type)`` of every ``tokenizer.ggml.*`` and
    ``tokenizer.chat_template`` field of ``tokenizer_gguf``, the token list (and its scores and
    types) padded to ``vocab_size`` as llama.cpp's converter pads a vocabulary.

    Raises:
        ValueError: the GGUF has no token list, or more tokens than ``vocab_size``.
    """
    from gguf import TokenType

    st = Path(tokenizer_gguf).stat()
    fields = _read_tokenizer_fields(str(tokenizer_gguf), st.st_size, st.st_mtime_ns)
    tokens = next((v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens"), None)
    if not isinstance(tokens, list):
        raise ValueError(f"{tokenizer_gguf} has no tokenizer.ggml.tokens")
    n_tokens = len(tokens)
    if n_tokens > vocab_size:
        raise ValueError(f"the vocabulary ({vocab_size}) must hold the tokenizer's {n_tokens} "
                         "tokens")
    pad = vocab_size - n_tokens
    fill = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(n_tokens, vocab_size)],
            "tokenizer.ggml.token_type": [int(TokenType.UNUSED)] * pad,
            "tokenizer.ggml.scores": [-1000.0] * pad}
    return [(k, v + fill[k] if k in fill and isinstance(v, list) and len(v) == n_tokens else v,
             t, s) for k, v, t, s in fields]


def _ggml_type(t_shape: tuple[int, ...], qtype_name: str) -> Any:
    """The ggml type a tensor of ``t_shape`` gets in a GGUF of ``qtype_name``: F32 for 1-D
    tensors (norms, biases) and in an F32 file; else ``qtype_name``, or BF16 where the row
    length is not a multiple of the quant block (llama.cpp's converter falls back likewise)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if len(t_shape) == 1 or qtype_name == "F32":
        return GGMLQuantizationType.F32
    qtype = GGMLQuantizationType[qtype_name]
    if t_shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        return GGMLQuantizationType.BF16
    return qtype


def _quantized(t: torch.Tensor, qtype_name: str) -> tuple[np.ndarray, Any]:
    """``(data, ggml type)`` of one tensor for the GGUF (type: :func:`_ggml_type`): BF16
    bit-exact from the bfloat16 values, F32, or quantized by gguf-py in row blocks of about
    :data:`_CHUNK` elements."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape, quantize

    qtype = _ggml_type(tuple(t.shape), qtype_name)
    if qtype == GGMLQuantizationType.F32:
        return t.to(torch.float32).numpy(), qtype
    if qtype == GGMLQuantizationType.BF16:
        # what gguf.quants.quantize(x.float(), BF16) gives (round-to-nearest-even of values
        # that are already bfloat16), without the float32 copy
        return t.contiguous().view(torch.int16).numpy().view(np.uint8), qtype
    out = np.empty(quant_shape_to_byte_shape(tuple(t.shape), qtype), dtype=np.uint8)
    rows = max(1, _CHUNK // t.shape[-1])
    for r in range(0, t.shape[0], rows):
        out[r:r + rows] = quantize(t[r:r + rows].to(torch.float32).numpy(), qtype)
    return out, qtype


def write_gguf(folder: Path, shape: ModelShape, path: Path, qtype_name: str,
               tokenizer_gguf: Path, log: Callable[[str], None] | None = None) -> None:
    """Write ``path``: the folder's weights (read back one tensor at a time from its shards)
    as a llama.cpp GGUF of ``qtype_name`` (one of :data:`GGUF_PY_TYPES`), with the tokenizer
    metadata of ``tokenizer_gguf`` (the default model's GGUF in :func:`make_model`).

    Raises:
        ValueError: ``tokenizer_gguf`` has no token list, or more tokens than the vocabulary.
        OSError: the file cannot be written.
        RuntimeError: an internal inconsistency (the tensor table and data disagree).
    """
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

    arch = shape.model_type  # "llama" or "qwen2": also llama.cpp's architecture names
    file_type = {"BF16": LlamaFileType.MOSTLY_BF16, "F32": LlamaFileType.ALL_F32,
                 "Q8_0": LlamaFileType.MOSTLY_Q8_0, "Q4_0": LlamaFileType.MOSTLY_Q4_0,
                 "Q4_1": LlamaFileType.MOSTLY_Q4_1}[qtype_name]
    w = GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name(f"radixserve random {shape.name}")
    w.add_description(f"shape of {shape.source}; {NOTE}")
    w.add_vocab_size(shape.vocab_size)
    w.add_context_length(shape.max_position_embeddings)
    w.add_embedding_length(shape.hidden_size)
    w.add_block_count(shape.num_hidden_layers)
    w.add_feed_forward_length(shape.intermediate_size)
    w.add_head_count(shape.num_attention_heads)
    w.add_head_count_kv(shape.num_key_value_heads)
    w.add_layer_norm_rms_eps(shape.rms_norm_eps)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_rope_dimension_count(shape.dim_per_head)
    if shape.head_dim is not None:
        w.add_key_length(shape.head_dim)
        w.add_value_length(shape.head_dim)
    w.add_file_type(int(file_type))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub in _tokenizer_fields(tokenizer_gguf, shape.vocab_size):
        w.add_key_value(key, value, vtype, sub_type=sub)

    rope_freqs = None
    if shape.rope_scaling and shape.rope_scaling.get("rope_type") == "llama3":
        rope_freqs = np.asarray(llama3_rope_factors(shape), dtype=np.float32)

    def tensors() -> Iterator[tuple[str, np.ndarray, Any]]:
        if rope_freqs is not None:
            yield "rope_freqs.weight", rope_freqs, GGMLQuantizationType.F32
        for name, t in iter_folder_tensors(folder):
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = (shape.num_attention_heads if "q_proj" in name
                         else shape.num_key_value_heads)
                t = _permute_rows(t, heads)
            data, qtype = _quantized(t, qtype_name)
            yield _gguf_name(name), data, qtype

    # Pass 1: the tensor table (types and byte sizes, from the shapes alone: nothing is read or
    # quantized yet). Pass 2: the data, in the same order, one tensor at a time.
    table = _gguf_table(folder, shape, qtype_name, rope_freqs is not None)
    for name, t_shape, qtype in table:
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor_info(name, t_shape, np.dtype(np.float32), 4 * math.prod(t_shape))
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(t_shape, qtype)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape),
                              raw_dtype=qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for n, ((name, _, qtype), (got_name, data, got_qtype)) in enumerate(
                zip(table, tensors(), strict=True), 1):
            if (got_name, got_qtype) != (name, qtype):  # the two passes disagree: a bug here
                raise RuntimeError(f"GGUF tensor {n}: table has {name} {qtype.name}, data is "
                                   f"{got_name} {got_qtype.name}")
            w.write_tensor_data(data)
            if log and n % 50 == 0:
                log(f"{path.name}: {n} of {len(table)} tensors written")
    finally:
        w.close()
    if log:
        log(f"wrote {path.name} ({path.stat().st_size / 1e9:.2f} GB)")


def _gguf_table(folder: Path, shape: ModelShape, qtype_name: str,
                with_rope_freqs: bool) -> list[tuple[str, tuple[int, ...], Any]]:
    """``(GGUF name, torch shape, ggml type)`` of every tensor :func:`write_gguf` writes, in
    its order, from the safetensors headers (no data read)."""
    from gguf import GGMLQuantizationType
    from safetensors import safe_open

    table: list[tuple[str, tuple[int, ...], Any]] = []
    if with_rope_freqs:
        table.append(("rope_freqs.weight", (shape.dim_per_head // 2,),
                      GGMLQuantizationType.F32))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                t_shape = tuple(f.get_slice(name).get_shape())
                table.append((_gguf_name(name), t_shape, _ggml_type(t_shape, qtype_name)))
    return table


_QUANTIZE_SCRIPT = r"""
import ctypes, sys
import llama_cpp
llama_cpp.llama_backend_init()
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = 0
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(),
                                    ctypes.byref(params))
sys.exit(1 if rc else 0)
"""


def _peers_python(peers_venv: Path) -> Path:
    """The peers venv's Python, checked to import ``llama_cpp``.

    Raises:
        ValueError: no such venv, or llama-cpp-python is not importable there (the message
            says to run ``make bench-peers``).
    """
    python = Path(peers_venv) / "bin" / "python"
    hint = ("Q4_K_M, Q5_K_M and Q6_K are made by llama.cpp's quantizer from llama-cpp-python "
            f"in the peers venv {peers_venv}; run `make bench-peers` to build it")
    if not python.exists():
        raise ValueError(f"{hint} (there is no {python})")
    try:
        r = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True,
                           text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ValueError(f"{hint} ({python} failed: {e})") from e
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise ValueError(f"{hint} ({python} cannot import llama_cpp: {tail})")
    return python


def llama_cpp_quantize(python: Path, src: Path, dst: Path, qtype_name: str) -> None:
    """Quantize the GGUF ``src`` into ``dst`` with llama.cpp's ``llama_model_quantize`` (what
    ``llama-quantize`` runs: its per-tensor type mix for the ``_M`` types, its fallbacks for
    rows that are not a multiple of 256), in a subprocess of the peers venv's ``python``.

    Raises:
        RuntimeError: the quantizer failed (the message holds the end of its output).
    """
    from gguf import LlamaFileType

    ftype = {"Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M, "Q5_K_M": LlamaFileType.MOSTLY_Q5_K_M,
             "Q6_K": LlamaFileType.MOSTLY_Q6_K}[qtype_name]
    r = subprocess.run([str(python), "-c", _QUANTIZE_SCRIPT, str(src), str(dst),
                        str(int(ftype))], capture_output=True, text=True)
    if r.returncode != 0 or not dst.is_file():
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"llama.cpp's quantizer failed making {dst.name} "
                           f"(exit {r.returncode}):\n{tail}")


# ------------------------------------------------------------------------------- entry point
def _estimate_bytes(specs: list[TensorSpec], gguf_type: str | None) -> int:
    """Disk bytes the call will write, roughly (the free-space check)."""
    params = sum(s.numel for s in specs)
    total = 2 * params
    per_elem = {"BF16": 2.0, "F32": 4.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32,
                "Q4_K_M": 2.0 + 0.62, "Q5_K_M": 2.0 + 0.72, "Q6_K": 2.0 + 0.83}
    if gguf_type:
        total += int(per_elem[gguf_type] * params)
    return total + 64 * 2**20


def make_model(shape_name: str, out: str | os.PathLike, *, gguf: str | None = None,
               seed: int = 0, num_layers: int | None = None, vocab_size: int | None = None,
               tokenizer_folder: str | os.PathLike | None = None,
               tokenizer_gguf: str | os.PathLike | None = None,
               peers_venv: str | os.PathLike = ".venv-peers",
               max_shard_bytes: int = SHARD_BYTES,
               log: Callable[[str], None] | None = None) -> MadeModel:
    """Write a random-weight model with the layer shapes of ``shape_name`` into ``out``.

    The model's text is gibberish; its speed is real (see the module docstring for the files).
    Cost: about the time to draw and write 2 bytes per parameter (a 7B model: 15 GB), plus the
    GGUF's; memory stays near one 2 GB shard plus the largest tensor.

    Args:
        shape_name: a key of :data:`SHAPES`.
        out: the folder to create; it must not exist or be empty. Its parent is created.
        gguf: also write ``<shape>-<gguf>.gguf`` of this type (:data:`GGUF_TYPES`, any case).
        seed: the weights' seed (the same seed and shape give the same bytes).
        num_layers: override the layer count (tests, quick runs).
        vocab_size: override the vocabulary (embedding rows); at least the tokenizer's 49152.
        tokenizer_folder: where to copy the tokenizer files from (default: the default model's
            converted folder, ``resolve_model(None).folder``).
        tokenizer_gguf: the GGUF whose tokenizer metadata the GGUF gets (default: the default
            model's); it should hold the same tokenizer as ``tokenizer_folder``.
        peers_venv: the venv with llama-cpp-python, for the K-quant types.
        max_shard_bytes: largest safetensors shard, bytes.
        log: called with a progress line per shard and per 50 GGUF tensors.

    Returns:
        A :class:`MadeModel`.

    Raises:
        ValueError: unknown shape (listing the known ones) or GGUF type (listing them), bad
            override, ``out`` exists and is not an empty folder, a vocabulary smaller than the
            tokenizer, not enough free disk space, or a K type without llama-cpp-python in
            ``peers_venv`` (saying to run ``make bench-peers``).
        RuntimeError: llama.cpp's quantizer failed.
        OSError: writing failed (e.g. disk full); nothing is left in ``out``.
        FileNotFoundError: the default model is not installed (and its tokenizer is needed).
    """
    start = time.perf_counter()
    shape = resolve_shape(shape_name, num_layers, vocab_size)
    qtype = None
    if gguf is not None:
        qtype = gguf.upper()
        if qtype not in GGUF_TYPES:
            raise ValueError(f"unknown GGUF type {gguf!r}; choose from {', '.join(GGUF_TYPES)}")
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder; pass a new folder")
    python = _peers_python(Path(peers_venv)) if qtype in LLAMA_CPP_TYPES else None

    specs = tensor_specs(shape)
    out.parent.mkdir(parents=True, exist_ok=True)
    need = _estimate_bytes(specs, qtype)
    free = shutil.disk_usage(out.parent).free
    if need > free:
        raise ValueError(f"{shape.name} needs about {need / 1e9:.1f} GB of disk in {out.parent}, "
                         f"which has {free / 1e9:.1f} GB free")
    tok_src = Path(tokenizer_folder) if tokenizer_folder else _default_tokenizer_folder()
    tok_gguf = Path(tokenizer_gguf) if tokenizer_gguf else None
    if qtype is not None and tok_gguf is None:
        from radixserve.model_executor.loader import default_model_path

        tok_gguf = default_model_path()

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        token_ids, n_tokens = _copy_tokenizer(tok_src, tmp, shape.max_position_embeddings)
        if n_tokens > shape.vocab_size:
            raise ValueError(f"--vocab-size {shape.vocab_size} is smaller than the tokenizer's "
                             f"{n_tokens} tokens")
        overrides = {k: v for k, v in (("num_hidden_layers", num_layers),
                                       ("vocab_size", vocab_size)) if v is not None}
        cfg = config_dict(shape, seed, overrides, token_ids)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {k: v for k, v in token_ids.items() if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

        nbytes, n_shards = write_safetensors(tmp, specs, seed, max_shard_bytes, log)

        gguf_name = None
        if qtype is not None:
            assert tok_gguf is not None
            gguf_name = f"{shape.name}-{qtype}.gguf"
            if python is None:
                write_gguf(tmp, shape, tmp / gguf_name, qtype, tok_gguf, log)
            else:
                src = tmp / f".{shape.name}-BF16.tmp.gguf"
                write_gguf(tmp, shape, src, "BF16", tok_gguf, log)
                if log:
                    log(f"quantizing to {qtype} with llama.cpp")
                llama_cpp_quantize(python, src, tmp / gguf_name, qtype)
                src.unlink()

        marker = {"shape": shape.name, "like": shape.source, "seed": seed,
                  "overrides": overrides, "num_parameters": sum(s.numel for s in specs),
                  "num_tensors": len(specs), "safetensors_bytes": nbytes,
                  "num_shards": n_shards, "gguf": gguf_name, "tokenizer_from": str(tok_src),
                  "note": NOTE}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700, safetensors' files are 0600
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.rename(tmp, out)  # replaces an empty ``out``
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    gguf_path = out / gguf_name if gguf_name else None
    return MadeModel(folder=out, gguf=gguf_path, shape=shape.name,
                     num_parameters=marker["num_parameters"], safetensors_bytes=nbytes,
                     num_shards=n_shards,
                     gguf_bytes=gguf_path.stat().st_size if gguf_path else None,
                     seconds=time.perf_counter() - start)
