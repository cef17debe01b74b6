"""Model loader on the real default model (SmolLM2-135M-Instruct Q4_1): its GGUF conversion (into
the normal cache, so `radixserve serve` and the other integration tests reuse it) against
transformers' own GGUF load of the weights and of the tokenizer. The mechanics of conversion on
tiny random GGUF files are unit tests (tests/unit/test_loader.py)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve.model_executor.loader import (
    ModelFiles,
    auto_tokenizer_class,
    checkpoint_weights,
    declared_tokenizer_class,
    default_model_path,
    eos_token_ids,
    export_hf_weights,
    gguf_loader,
    gguf_to_hf_folder,
    iter_safetensors,
    load_hf_config,
    load_tokenizer,
    resolve_model,
    tokenizer_class_path,
)

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Emoji: 🙂🚀👩‍💻 and accents: naïve café résumé",
    "中文：你好，世界。日本語：こんにちは。한국어: 안녕하세요",
    "def f(x):\n    return x ** 2  # code 12345 3.14159",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "",
]


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def converted(default_gguf) -> Path:
    """The default model converted into the normal cache (a no-op once it is there)."""
    return gguf_to_hf_folder(default_gguf)


@pytest.fixture(scope="session")
def gguf_tokenizer(hf_reference):
    """transformers' tokenizer read from the GGUF file (shared with the parity reference)."""
    return hf_reference[1]


def test_conversion_is_cached(default_gguf, converted, monkeypatch):
    files = {p.name for p in converted.iterdir()}
    assert set(gguf_loader.REQUIRED_FILES) <= files
    assert "special_tokens_map.json" in files
    marker = json.loads((converted / gguf_loader.MARKER_FILE).read_text())
    assert marker["source"] == str(default_gguf)
    # cached: the second call converts nothing and rewrites nothing (the property; its speed is
    # a benchmark's business)
    mtimes = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}

    def no_conversion(path, out):
        raise AssertionError(f"{path} was converted again although it is cached")

    monkeypatch.setattr(gguf_loader, "_convert", no_conversion)
    again = gguf_to_hf_folder(default_gguf)
    assert again == converted
    assert {p.name: p.stat().st_mtime_ns for p in converted.iterdir()} == mtimes

    mf = resolve_model(None)
    assert mf == ModelFiles(converted, str(default_gguf), "SmolLM2-135M-Instruct",
                            default_gguf.resolve())
    # the same file named explicitly keeps the default model's name
    assert resolve_model(str(default_gguf)).name == "SmolLM2-135M-Instruct"


def test_weights_equal_transformers_gguf_load(converted, hf_reference):
    """radixserve reads the GGUF's tensors itself (gguf-py's dequantization, its own
    un-permutation of q/k); transformers' own GGUF load is the independent reference."""
    ref_model = hf_reference[0]  # transformers' float32 load of the same GGUF file
    cfg = ref_model.config
    assert not list(converted.glob("*.safetensors"))  # no float copy is written
    ours = {n: t.full() for n, t in checkpoint_weights(
        resolve_model(None), cfg.num_attention_heads, cfg.num_key_value_heads)}
    ref = ref_model.state_dict()
    assert cfg.tie_word_embeddings
    # tied: transformers' state dict repeats the embedding as lm_head.weight; the file omits it
    assert "lm_head.weight" not in ours
    assert set(ours) == set(ref) - {"lm_head.weight"}
    assert len(ours) == 272
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, ref[name]), name


def test_exported_weight_folder_for_peers(tmp_path, hf_reference):
    """The folder handed to peers that only load safetensors: transformers' GGUF weights."""
    folder = export_hf_weights(default_model_path(), "float32", cache_dir=tmp_path)
    weights = dict(iter_safetensors(folder))
    ref = hf_reference[0].state_dict()
    assert set(weights) == set(ref) - {"lm_head.weight"}
    assert all(torch.equal(t, ref[n]) for n, t in weights.items())
    assert load_hf_config(folder).hidden_size == 576
    assert export_hf_weights(default_model_path(), "float32", cache_dir=tmp_path) == folder


def test_config_and_eos(converted):
    config = load_hf_config(converted)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        576, 1536, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.max_position_embeddings == 8192
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings is True
    assert math.isclose(config.rms_norm_eps, 1e-5, rel_tol=1e-6)
    assert eos_token_ids(converted, config) == [2]


def test_tokenizer_matches_gguf_tokenizer(converted, gguf_tokenizer):
    tok = load_tokenizer(converted)
    assert tok.is_fast
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == gguf_tokenizer.encode(text), text
        assert tok.decode(ids) == text
    assert tok("<|im_end|>")["input_ids"] == [2]  # special tokens are single ids, no BOS added


def _qwen2_folder(converted: Path, dest: Path) -> Path:
    """The default model's tokenizer files under a Qwen2 config, as ``bench make-model`` writes
    them: AutoTokenizer builds transformers' Qwen2 class there, not the declared one."""
    dest.mkdir()
    for f in converted.iterdir():
        if f.name != "config.json" and f.is_file():
            shutil.copy(f, dest / f.name)
    cfg = json.loads((converted / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(
        {**cfg, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    return dest


def test_tokenizer_by_class_is_autotokenizers_without_torch(converted, tmp_path):
    """The API process loads the class the engine names (``EngineInfo.tokenizer_class``): the
    same tokenizer as AutoTokenizer's, whichever class that is, and torch left unimported."""
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    classes = set()
    for folder in (converted, _qwen2_folder(converted, tmp_path / "qwen2")):
        cls = auto_tokenizer_class(folder)
        classes.add(cls)
        auto, direct = AutoTokenizer.from_pretrained(str(folder)), load_tokenizer(folder, cls)
        assert tokenizer_class_path(type(direct)) == tokenizer_class_path(type(auto)) == cls
        for text in TEXTS:
            assert direct.encode(text) == auto.encode(text), (folder, text)
        assert (direct.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        assert direct.all_special_ids == auto.all_special_ids
        probe = (f"import sys; from pathlib import Path\n"
                 f"from radixserve.model_executor.loader import load_tokenizer\n"
                 f"tok = load_tokenizer(Path({str(folder)!r}), {cls!r})\n"
                 f"print(tok.encode({TEXTS[0]!r}), 'torch' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             check=True).stdout.split("] ")
        assert out[0] + "]" == str(auto.encode(TEXTS[0])) and out[1].strip() == "False", out
    # the Qwen2 folder declares the generic class, and AutoTokenizer overrides it: the engine's
    # answer, not the declared guess, has to decide
    assert len(classes) == 2
    assert declared_tokenizer_class(tmp_path / "qwen2") == declared_tokenizer_class(converted)
    assert declared_tokenizer_class(converted) in classes


def test_declared_tokenizer_class_guesses(converted, tmp_path):
    folder = tmp_path / "t"
    shutil.copytree(converted, folder)
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    for name, want in [("GPT2TokenizerFast", "transformers.models.gpt2.tokenization_gpt2:"
                        "GPT2Tokenizer"), ("NoSuchTokenizer", ""), ("AutoConfig", "")]:
        tc_path.write_text(json.dumps({**tc, "tokenizer_class": name}))
        assert declared_tokenizer_class(folder) == want
    # remote code is never guessed at, nor anything loaded but a tokenizer class of transformers
    tc_path.write_text(json.dumps({**tc, "auto_map": {"AutoTokenizer": [None, "x.Tok"]}}))
    assert declared_tokenizer_class(folder) == ""
    tc_path.write_text(json.dumps(tc))
    auto_type = type(load_tokenizer(folder))
    for path in ("json:JSONDecoder", "transformers.models.auto.configuration_auto:AutoConfig"):
        assert type(load_tokenizer(folder, path)) is auto_type  # AutoTokenizer, not the path
    tc_path.unlink()
    assert declared_tokenizer_class(folder) == ""


def test_chat_template(converted, gguf_tokenizer):
    tok = load_tokenizer(converted)
    tc = json.loads((converted / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tc["chat_template"]
    messages = [{"role": "user", "content": "Hello 🙂"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHello 🙂<|im_end|>\n<|im_start|>assistant\n")
    assert text == gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text) == gguf_tokenizer.encode(text)
