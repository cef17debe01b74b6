"""``radixserve bench make-model``: random-weight models with real models' layer shapes.

* every shape: config.json and the shards' tensor shapes, on 1-layer variants (zeros instead of
  random draws: only shapes are checked, so a 7B layer costs only its disk writes);
* 2-layer qwen2.5-0.5b (Qwen2: q/k/v biases, tied) and llama-3.2-1b (llama3 RoPE scaling,
  llama.cpp's q/k row permutation) in radixserve: the folder, its BF16 GGUF (the same greedy
  tokens) and a Q8_0 GGUF. These use a 264-token byte-level BPE tokenizer (a tokenizer-only
  GGUF and the Hugging Face folder transformers makes of it) and a 512-row vocabulary, because
  radixserve's one-time conversion of a GGUF with the default 49k-token tokenizer takes ~20 s
  of CPU;
* the default tokenizer (the default model's converted folder, ``resolve_model(None)``, and its
  GGUF's metadata; no real weights): a folder that radixserve loads and runs on text prompts,
  and a Q8_0 GGUF whose padded vocabulary, tokenizer metadata and values are read back.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from radixserve.bench import make_model as mm  # noqa: E402

#: the real config.json values each shape must reproduce (written out independently of SHAPES)
EXPECTED: dict[str, dict] = {
    "qwen2.5-0.5b": dict(arch="Qwen2ForCausalLM", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                         rms_norm_eps=1e-6, max_position_embeddings=32768, head_dim=64,
                         rope=None, bias=True),
    "qwen2.5-1.5b": dict(arch="Qwen2ForCausalLM", hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                         rms_norm_eps=1e-6, max_position_embeddings=32768, head_dim=128,
                         rope=None, bias=True),
    "qwen2.5-7b": dict(arch="Qwen2ForCausalLM", hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       vocab_size=152064, tie_word_embeddings=False, rope_theta=1e6,
                       rms_norm_eps=1e-6, max_position_embeddings=32768, head_dim=128,
                       rope=None, bias=True),
    "llama-3.2-1b": dict(arch="LlamaForCausalLM", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=131072, head_dim=64,
                         rope=32.0, bias=False),
    "llama-3.1-8b": dict(arch="LlamaForCausalLM", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=131072, head_dim=128,
                         rope=8.0, bias=False),
}
_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "tie_word_embeddings", "rms_norm_eps", "max_position_embeddings")


def _check_config(cfg, want: dict, layers: int, vocab: int) -> None:
    """A transformers config read back from a made folder against the real values."""
    assert cfg.architectures == [want["arch"]]
    for key in _CONFIG_KEYS:
        assert getattr(cfg, key) == want[key], key
    assert cfg.num_hidden_layers == layers and cfg.vocab_size == vocab
    rope = cfg.rope_parameters
    assert rope["rope_theta"] == want["rope_theta"]
    if want["rope"] is None:
        assert rope.get("rope_type", "default") == "default"
        assert cfg.use_sliding_window is False
    else:
        assert rope["rope_type"] == "llama3" and rope["factor"] == want["rope"]
        assert (rope["low_freq_factor"], rope["high_freq_factor"]) == (1.0, 4.0)
        assert rope["original_max_position_embeddings"] == 8192
    assert (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) == \
        want["head_dim"]


def _shard_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the shards' headers, checked against the index."""
    from safetensors import safe_open

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert sorted(p.name for p in folder.glob("*.safetensors")) == files
    n = len(files)
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    shapes: dict[str, tuple[int, ...]] = {}
    total = 0
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert index["weight_map"][name] == file
                sl = f.get_slice(name)
                assert sl.get_dtype() == "BF16", name
                shapes[name] = tuple(sl.get_shape())
                total += 2 * math.prod(shapes[name])
    assert total == index["metadata"]["total_size"]
    assert set(shapes) == set(index["weight_map"])
    return shapes


def _implied_shapes(cfg, bias: bool) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensor names and shapes a config implies."""
    h, inter, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    want = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        want["lm_head.weight"] = (v, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        want |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                 p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                 p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                 p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                 p + "mlp.down_proj.weight": (h, inter)}
        if bias:
            want |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                     p + "self_attn.v_proj.bias": (kv,)}
    return want


# ------------------------------------------------------------------------- tiny tokenizer
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "e ll"]
#: rows of the tiny models' embeddings (the tiny tokenizer has 264 tokens: 248 padding rows)
TINY_VOCAB = 512
#: rows of the models with the default tokenizer (its 49152 tokens + 128 padding rows)
VOCAB = 49152 + 128


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory) -> tuple[Path, Path]:
    """``(Hugging Face tokenizer folder, tokenizer-only GGUF)`` of a byte-level BPE tokenizer
    (the special tokens, the 256 byte symbols, 5 merges; bos 1, eos 2), written as llama.cpp
    writes a gpt2-style vocabulary; the folder is what transformers makes of the GGUF."""
    import gguf
    from transformers import AutoTokenizer

    from radixserve.frontend.tokenizer import bytes_to_unicode

    root = tmp_path_factory.mktemp("tiny_tok")
    table = bytes_to_unicode()
    tokens = SPECIALS + [table[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES]
    path = root / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    folder = root / "hf"
    AutoTokenizer.from_pretrained(str(root), gguf_file=path.name).save_pretrained(str(folder))
    (folder / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    return folder, path


# ------------------------------------------------------------------------------ every shape
@pytest.mark.parametrize("name", list(EXPECTED))
def test_config_and_shard_shapes(name: str, tmp_path: Path, monkeypatch,
                                 tiny_tok: tuple[Path, Path]) -> None:
    """config.json reads back (AutoConfig) with the real model's values (layers and vocabulary
    as overridden; the full values in the un-overridden config), and the shards hold exactly
    the tensors, of exactly the shapes, that config implies, in shards of at most the limit."""
    from transformers import AutoConfig

    want = EXPECTED[name]
    # zeros instead of random draws: only shapes are checked here, and a 7B layer is 233M values
    monkeypatch.setattr(mm, "generate_tensor",
                        lambda spec, seed: torch.zeros(spec.shape, dtype=torch.bfloat16))
    limit = 200 * 10**6
    made = mm.make_model(name, tmp_path / "m", num_layers=1, vocab_size=TINY_VOCAB, seed=3,
                         tokenizer_folder=tiny_tok[0], max_shard_bytes=limit)
    folder = made.folder
    cfg = AutoConfig.from_pretrained(folder)
    _check_config(cfg, want, layers=1, vocab=TINY_VOCAB)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)  # the tokenizer's
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    note = json.loads((folder / "config.json").read_text())["radixserve_random_model"]
    assert note["shape"] == name and "gibberish" in note["note"]
    marker = json.loads((folder / mm.MARKER_FILE).read_text())
    assert marker["overrides"] == {"num_hidden_layers": 1, "vocab_size": TINY_VOCAB}
    assert marker["seed"] == 3

    shapes = _shard_shapes(folder)
    assert shapes == _implied_shapes(cfg, want["bias"])
    assert made.num_parameters == sum(math.prod(s) for s in shapes.values())
    assert made.num_shards == len(list(folder.glob("*.safetensors")))
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    for f in folder.glob("*.safetensors"):
        names = [n for n, file in weight_map.items() if file == f.name]
        assert sum(2 * math.prod(shapes[n]) for n in names) <= limit or len(names) == 1
    assert (folder / "tokenizer.json").read_bytes() == (tiny_tok[0] / "tokenizer.json").read_bytes()
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_cfg["model_max_length"] == want["max_position_embeddings"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary folder left

    # the config without overrides: the real model's layer count and vocabulary
    full = mm.config_dict(mm.SHAPES[name], 0, {}, {"eos_token_id": 2})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text(json.dumps(full))
    _check_config(AutoConfig.from_pretrained(tmp_path / "full"), want,
                  layers=want["num_hidden_layers"], vocab=want["vocab_size"])
    full_specs = {s.name: s.shape for s in mm.tensor_specs(mm.SHAPES[name])}
    assert full_specs == _implied_shapes(AutoConfig.from_pretrained(tmp_path / "full"),
                                         want["bias"])


def test_real_parameter_counts() -> None:
    """The full shapes have the real models' parameter counts (the published totals)."""
    counts = {name: sum(math.prod(s.shape) for s in mm.tensor_specs(shape))
              for name, shape in mm.SHAPES.items()}
    assert counts["qwen2.5-0.5b"] == 494_032_768
    assert counts["qwen2.5-1.5b"] == 1_543_714_304
    assert counts["qwen2.5-7b"] == 7_615_616_512
    assert counts["llama-3.2-1b"] == 1_235_814_400
    assert counts["llama-3.1-8b"] == 8_030_261_248


def test_weights_are_seeded_per_tensor() -> None:
    """The same seed and tensor name give the same values (whatever else the model holds);
    linear weights have std 1/sqrt(in_features), norms are ones."""
    spec = mm.TensorSpec("model.layers.0.mlp.down_proj.weight", (64, 4864), "normal",
                         1 / math.sqrt(4864))
    a, b = mm.generate_tensor(spec, 0), mm.generate_tensor(spec, 0)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    assert not torch.equal(a, mm.generate_tensor(spec, 1))
    other = mm.TensorSpec("model.layers.1.mlp.down_proj.weight", spec.shape, "normal", spec.std)
    assert not torch.equal(a, mm.generate_tensor(other, 0))
    assert abs(a.float().std().item() * math.sqrt(4864) - 1) < 0.02
    ones = mm.generate_tensor(mm.TensorSpec("model.norm.weight", (8,), "ones"), 0)
    assert torch.equal(ones, torch.ones(8, dtype=torch.bfloat16))


def test_shard_plan_respects_the_limit() -> None:
    specs = mm.tensor_specs(mm.SHAPES["qwen2.5-7b"])
    shards = mm.plan_shards(specs)
    assert [s.name for shard in shards for s in shard] == [s.name for s in specs]
    for shard in shards:
        size = sum(2 * s.numel for s in shard)
        assert size <= mm.SHARD_BYTES or len(shard) == 1
    assert len(shards) == 9  # 15.2 GB in shards of at most 2 GB


# -------------------------------------------------------------------- errors (nothing written)
def test_unknown_shape_and_type(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown shape 'nope'; known shapes: qwen2\.5-0\.5b, "
                                         r"qwen2\.5-1\.5b, qwen2\.5-7b, llama-3\.2-1b, "
                                         r"llama-3\.1-8b"):
        mm.make_model("nope", tmp_path / "m")
    with pytest.raises(ValueError, match=r"unknown GGUF type 'Q3_X'; choose from BF16, F32, "
                                         r"Q8_0, Q4_0, Q4_1, Q4_K_M, Q5_K_M, Q6_K"):
        mm.make_model("qwen2.5-0.5b", tmp_path / "m", gguf="Q3_X")
    with pytest.raises(ValueError, match="--num-layers must be at least 1"):
        mm.make_model("qwen2.5-0.5b", tmp_path / "m", num_layers=0)
    assert not (tmp_path / "m").exists()


def test_out_must_be_new_or_empty(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "x").write_text("")
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        mm.make_model("qwen2.5-0.5b", out, num_layers=1, vocab_size=VOCAB)
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        mm.make_model("qwen2.5-0.5b", tmp_path / "f", num_layers=1, vocab_size=VOCAB)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "m"]  # no temporary left


def test_vocab_smaller_than_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="smaller than the tokenizer's 49152 tokens"):
        mm.make_model("qwen2.5-0.5b", tmp_path / "m", num_layers=1, vocab_size=1000)
    assert list(tmp_path.iterdir()) == []  # the temporary folder is gone


def test_k_quant_without_peers_venv(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"make bench-peers"):
        mm.make_model("qwen2.5-0.5b", tmp_path / "m", gguf="q4_k_m",
                      peers_venv=tmp_path / "no-venv")
    assert list(tmp_path.iterdir()) == []


def test_cli_unknown_shape(tmp_path: Path, capsys) -> None:
    from radixserve.cli import main

    assert main(["bench", "make-model", "--shape", "nope", str(tmp_path / "m")]) != 0
    err = capsys.readouterr().err
    assert "unknown shape 'nope'" in err
    assert all(name in err for name in EXPECTED)
    assert not (tmp_path / "m").exists()


def test_cli_subprocess_unknown_shape(tmp_path: Path) -> None:
    """The installed entry point exits non-zero naming the known shapes."""
    r = subprocess.run([sys.executable, "-m", "radixserve.cli", "bench", "make-model",
                        "--shape", "nope", str(tmp_path / "m")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    assert "known shapes: qwen2.5-0.5b" in r.stderr and "llama-3.1-8b" in r.stderr


# ----------------------------------------------------------- tiny random models in radixserve
@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_tok):
    """2-layer qwen2.5-0.5b (BF16 GGUF) and llama-3.2-1b (BF16 and Q8_0 GGUFs) with the tiny
    tokenizer and :data:`TINY_VOCAB` rows; the folders radixserve converts the GGUFs' metadata
    into are removed afterwards."""
    from radixserve.model_executor.loader.gguf_loader import converted_folder_path

    root = tmp_path_factory.mktemp("tiny_models")
    kw = dict(num_layers=2, vocab_size=TINY_VOCAB, tokenizer_folder=tiny_tok[0],
              tokenizer_gguf=tiny_tok[1])
    made = {"qwen": mm.make_model("qwen2.5-0.5b", root / "qwen", gguf="BF16", **kw),
            "llama": mm.make_model("llama-3.2-1b", root / "llama", gguf="bf16", **kw)}
    llama_q8 = made["llama"].folder / "llama-3.2-1b-Q8_0.gguf"
    mm.write_gguf(made["llama"].folder, mm.resolve_shape("llama-3.2-1b", 2, TINY_VOCAB),
                  llama_q8, "Q8_0", tiny_tok[1])
    ggufs = [made["qwen"].gguf, made["llama"].gguf, llama_q8]
    try:
        yield {**made, "llama_q8": llama_q8}
    finally:
        for gguf in ggufs:
            shutil.rmtree(converted_folder_path(gguf), ignore_errors=True)


def _greedy(model: str, prompts: list, n: int = 6) -> list[list[int]]:
    """Greedy token ids (``n`` each) of radixserve in float32 for token-id or text prompts."""
    from radixserve import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", page_size=16, num_pages=32, max_model_len=128,
              pack_weights=False, cpu_linear_kernel=False)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts],
                        sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


#: token ids of the tiny tokenizer (300 and 511: padding rows) and a text prompt
TINY_PROMPTS = [[1, 40, 75, 200, 263], [5, 100, 300, 511, 42, 17, 9], "hello the world"]


@pytest.mark.parametrize("key", ["qwen", "llama"])
def test_folder_and_bf16_gguf_generate_the_same(tiny, key: str) -> None:
    """The folder loads and generates in radixserve; its BF16 GGUF (the same bfloat16 values,
    q/k rows permuted for llama, llama3 RoPE as ``rope_freqs``) gives the same greedy tokens."""
    made = tiny[key]
    from_folder = _greedy(str(made.folder), TINY_PROMPTS)
    assert [len(t) for t in from_folder] == [6, 6, 6]
    assert all(0 <= t < TINY_VOCAB for ts in from_folder for t in ts)
    assert _greedy(str(made.gguf), TINY_PROMPTS) == from_folder


def test_q8_0_gguf_loads_and_generates(tiny) -> None:
    """The Q8_0 GGUF of the llama model loads and generates in radixserve."""
    out = _greedy(str(tiny["llama_q8"]), TINY_PROMPTS, n=4)
    assert [len(t) for t in out] == [4, 4, 4]


def _read_gguf(path: Path) -> tuple[dict, dict, dict]:
    """``(metadata, {name: TensorInfo}, {name: LazyGgufTensor})`` by transformers' GGUF header
    reader (what radixserve's loader reads with; milliseconds, where gguf-py's reader takes
    seconds on a 49k-token vocabulary). The token list is read in full."""
    from transformers.integrations.gguf import (
        GgufHeader,
        load_gguf_state_dict,
        read_gguf_metadata,
    )

    meta, _ = read_gguf_metadata(str(path), string_arrays=("tokenizer.ggml.tokens",))
    header = GgufHeader.from_file(str(path))
    return meta, {t.name: t for t in header.tensors}, load_gguf_state_dict(header)


def test_llama_gguf_permutation_and_rope_freqs(tiny) -> None:
    """llama-arch BF16 GGUF: q/k rows in llama.cpp's permuted order, bit-exact, and the llama3
    ``rope_freqs`` factors (1 at high frequencies, 32 at low)."""
    from gguf import GGMLQuantizationType
    from safetensors import safe_open

    made = tiny["llama"]
    meta, infos, data = _read_gguf(made.gguf)
    assert meta["general.file_type"] == 32  # MOSTLY_BF16
    assert meta["llama.rope.dimension_count"] == 64 and meta["llama.rope.freq_base"] == 5e5
    assert meta["llama.attention.key_length"] == 64
    assert meta["llama.vocab_size"] == TINY_VOCAB
    freqs = data["rope_freqs.weight"][...]
    assert freqs.dtype == torch.float32 and freqs.shape == (32,)
    assert freqs[0] == 1.0 and freqs[-1] == 32.0 and bool((freqs[1:] >= freqs[:-1]).all())
    assert "output.weight" not in infos  # tied
    shard = sorted(made.folder.glob("*.safetensors"))[0]
    with safe_open(str(shard), framework="pt") as st:
        q = st.get_tensor("model.layers.1.self_attn.q_proj.weight")
        k = st.get_tensor("model.layers.0.self_attn.k_proj.weight")
        embed = st.get_tensor("model.embed_tokens.weight")
    assert infos["blk.0.attn_k.weight"].ggml_type == GGMLQuantizationType.BF16
    want_k = k.reshape(8, 2, 32, 2048).swapaxes(1, 2).reshape(512, 2048)
    assert not torch.equal(want_k, k)
    assert torch.equal(data["blk.0.attn_k.weight"][...], want_k)
    want_q = q.reshape(32, 2, 32, 2048).swapaxes(1, 2).reshape(2048, 2048)
    assert torch.equal(data["blk.1.attn_q.weight"][...], want_q)
    assert torch.equal(data["token_embd.weight"][...], embed)


# -------------------------------------------------------------------- the default tokenizer
@pytest.fixture(scope="module")
def real_tok(tmp_path_factory):
    """2-layer qwen2.5-0.5b with the default tokenizer and :data:`VOCAB` rows, and its Q8_0
    GGUF."""
    root = tmp_path_factory.mktemp("real_tok")
    return mm.make_model("qwen2.5-0.5b", root / "qwen", gguf="Q8_0", num_layers=2,
                         vocab_size=VOCAB)


def test_default_tokenizer_folder_generates(real_tok) -> None:
    """The folder holds the default tokenizer (49152 tokens, its chat template and eos) and
    runs in radixserve on text, on a chat prompt, and on ids of the padding rows."""
    from radixserve import LLM, SamplingParams

    folder = real_tok.folder
    assert (folder / "chat_template.jinja").is_file()
    llm = LLM(model=str(folder), dtype="float32", page_size=16, num_pages=32, max_model_len=128,
              pack_weights=False, cpu_linear_kernel=False)
    assert len(llm.get_tokenizer()) == 49152 and llm.eos_token_ids == [2]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(["The capital of France is", {"prompt_token_ids": [1, 49200, 49279]}],
                        sp, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    chat = llm.chat([{"role": "user", "content": "Hi!"}], sp, use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) == 5
    assert chat[0].prompt_token_ids[:1] == [1]  # <|im_start|>: the default template


def test_default_tokenizer_gguf_contents(real_tok) -> None:
    """The Q8_0 file as llama.cpp reads it: names, types and keys, the vocabulary padded with
    UNUSED ``[PAD<i>]`` tokens to the embedding's rows, the default model's tokenizer metadata,
    and values within Q8_0's rounding of the folder's bfloat16 values."""
    from gguf import GGMLQuantizationType, TokenType
    from gguf.quants import dequantize
    from safetensors import safe_open

    from radixserve.model_executor.loader import default_model_path

    meta, infos, data = _read_gguf(real_tok.gguf)
    assert real_tok.gguf.name == "qwen2.5-0.5b-Q8_0.gguf"
    assert meta["general.architecture"] == "qwen2"
    assert meta["general.file_type"] == 7  # MOSTLY_Q8_0
    assert meta["qwen2.block_count"] == 2 and meta["qwen2.embedding_length"] == 896
    assert meta["qwen2.feed_forward_length"] == 4864
    assert (meta["qwen2.attention.head_count"], meta["qwen2.attention.head_count_kv"]) == (14, 2)
    assert meta["qwen2.context_length"] == 32768 and meta["qwen2.rope.freq_base"] == 1e6
    assert meta["qwen2.vocab_size"] == VOCAB
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == VOCAB
    assert tokens[49152:] == [f"[PAD{i}]" for i in range(49152, VOCAB)]
    assert set(types[49152:]) == {TokenType.UNUSED} and TokenType.UNUSED not in types[:49152]
    default, _, _ = _read_gguf(default_model_path())
    assert tokens[:49152] == default["tokenizer.ggml.tokens"]
    assert types[:49152] == default["tokenizer.ggml.token_type"]
    keys = [k for k in default if k.startswith("tokenizer.")]
    assert "tokenizer.chat_template" in keys and "tokenizer.ggml.merges" in keys
    for key in keys:
        if key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            assert meta[key] == default[key], key
    assert infos["token_embd.weight"].ggml_type == GGMLQuantizationType.Q8_0
    assert infos["blk.1.attn_q.bias"].ggml_type == GGMLQuantizationType.F32
    assert infos["blk.1.ffn_norm.weight"].ggml_type == GGMLQuantizationType.F32
    assert "output.weight" not in infos and "rope_freqs.weight" not in infos  # tied; qwen2
    assert len(infos) == 1 + 2 * 12 + 1
    shard = sorted(real_tok.folder.glob("*.safetensors"))[0]
    with safe_open(str(shard), framework="pt") as st:
        ref = st.get_tensor("model.layers.1.self_attn.q_proj.weight").float().numpy()
        bias = st.get_tensor("model.layers.1.self_attn.q_proj.bias").float()
    raw = np.asarray(data["blk.1.attn_q.weight"].data).reshape(ref.shape[0], -1)
    got = dequantize(raw, GGMLQuantizationType.Q8_0)  # qwen2: rows not permuted
    blocks = ref.reshape(ref.shape[0], -1, 32)
    err = np.abs(got.reshape(blocks.shape) - blocks).max(axis=2)
    assert np.all(err <= np.abs(blocks).max(axis=2) / 127 * 0.6)  # half a step, f16 scale
    assert torch.equal(data["blk.1.attn_q.bias"][...], bias)


# ------------------------------------------------------------------ llama.cpp's K quants
PEERS_VENV = Path(__file__).resolve().parents[2] / ".venv-peers"


def _has_llama_cpp() -> bool:
    python = PEERS_VENV / "bin" / "python"
    return python.exists() and subprocess.run(
        [str(python), "-c", "import llama_cpp"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_llama_cpp(),
                    reason="llama-cpp-python is not in .venv-peers (make bench-peers)")
def test_k_quant_gguf(tmp_path: Path, tiny_tok) -> None:
    """Q4_K_M through llama.cpp's quantizer: that file type, llama.cpp's type mix (qwen2.5-0.5b's
    896-wide rows are not a multiple of 256, so most matrices fall back to Q5_0, as in the real
    model's Q4_K_M files), no temporary file left, and radixserve loads and runs it."""
    from collections import Counter

    from gguf import GGUFReader

    from radixserve.model_executor.loader.gguf_loader import converted_folder_path

    made = mm.make_model("qwen2.5-0.5b", tmp_path / "m", gguf="Q4_K_M", num_layers=1,
                         vocab_size=TINY_VOCAB, tokenizer_folder=tiny_tok[0],
                         tokenizer_gguf=tiny_tok[1], peers_venv=PEERS_VENV)
    assert sorted(p.name for p in made.folder.glob("*.gguf")) == ["qwen2.5-0.5b-Q4_K_M.gguf"]
    assert not [p for p in made.folder.iterdir() if p.name.startswith(".")]
    r = GGUFReader(str(made.gguf))
    assert r.fields["general.file_type"].contents() == 15  # MOSTLY_Q4_K_M
    assert len(r.tensors) == 1 + 12 + 1
    types = Counter(t.tensor_type.name for t in r.tensors)
    assert types["F32"] == 6 and "Q5_0" in types  # norms and biases and "BF16" not in types
    try:
        assert [len(t) for t in _greedy(str(made.gguf), TINY_PROMPTS[:1], n=3)] == [3]
    finally:
        shutil.rmtree(converted_folder_path(made.gguf), ignore_errors=True)
