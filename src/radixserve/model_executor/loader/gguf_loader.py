"""Turn a GGUF file's metadata, once, into the Hugging Face config and tokenizer files that the
rest of radixserve reads; the weights stay in the GGUF.

The conversion goes through ``transformers``' own GGUF support, so the result is by construction
what ``AutoConfig``/``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` produce:

* config: ``load_gguf_checkpoint(..., return_tensors=False)`` (llama.cpp metadata -> config keys),
  plus the few things transformers leaves out (see ``_complete_config``);
* tokenizer: ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` saved with ``save_pretrained``,
  with the GGUF chat template also written into ``tokenizer_config.json``;
* weights: none. The model reads them from the GGUF at load time (``gguf_weights``), into the
  serving dtype a block of rows at a time, so no float copy of the model is written or held (a
  7B Q4_K_M file would need 30 GB of float32). Only the tensor table is checked here, so a
  truncated file or an unknown type fails at once. Peers that need a weight folder (the
  transformers and vLLM benchmarks) get one from :func:`export_hf_weights`.

The folder is built in a temporary directory next to its final place and renamed into place, so a
reader never sees a half-written folder and two processes converting at once are safe (the second
rename loses, and its copy is thrown away). The cache key covers the GGUF's absolute path, size and
mtime, this converter's version and the transformers version.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from radixserve.cache_dir import cache_dir as radixserve_cache_dir

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 2
GGUF_MAGIC = b"GGUF"
MARKER_FILE = "radixserve-gguf.json"
"""Written last into a converted folder: where it came from and how it was converted."""
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json", MARKER_FILE)
_STALE_TMP_SECONDS = 6 * 3600


def is_gguf_file(path: Path) -> bool:
    """True when ``path`` is a readable file that starts with the GGUF magic bytes ``b"GGUF"``.

    Raises:
        OSError: the file exists but cannot be opened (e.g. permission denied).
    """
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def default_cache_root() -> Path:
    """The folder that holds converted GGUF models: ``cache_dir("gguf")``
    (``~/.cache/radixserve/gguf`` by default; see ``radixserve.cache_dir``)."""
    return radixserve_cache_dir("gguf")


def converted_folder_path(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Where :func:`gguf_to_hf_folder` puts (or has put) the conversion of ``gguf_path``.

    ``<cache_root>/<file stem>-<16 hex digits>``; the digits hash the absolute path, size and mtime
    (ns) of the file, :data:`CONVERTER_VERSION` and the installed transformers version, so an edited
    file, a new converter or a new transformers gets a fresh folder. Touches nothing on disk.

    Raises:
        OSError: ``gguf_path`` cannot be stat'ed.
    """
    path = Path(gguf_path).expanduser().resolve()
    st = path.stat()
    try:
        tf_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a hard dependency
        tf_version = "?"
    key = f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{CONVERTER_VERSION}\0{tf_version}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return root.resolve() / f"{path.stem}-{digest}"


def is_complete_folder(folder: Path) -> bool:
    """True when ``folder`` holds every file a finished conversion writes."""
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def gguf_to_hf_folder(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Convert a GGUF file into a Hugging Face model folder, once; later calls reuse it.

    The folder (see :func:`converted_folder_path` for its location) holds ``config.json`` (a
    transformers config with ``architectures``; no weights: see the module docstring),
    ``tokenizer.json``,
    ``tokenizer_config.json`` (with ``chat_template``), ``special_tokens_map.json``,
    ``chat_template.jinja`` (when the GGUF has a template), ``generation_config.json`` (eos ids)
    and ``radixserve-gguf.json`` (provenance, written last).

    Cost: the first call reads the metadata and builds the tokenizer (seconds; no tensor data is
    read); a cached call only stats the file (< 10 ms, and it imports neither torch nor
    transformers).

    Args:
        gguf_path: a GGUF v2/v3 file whose architecture transformers can load (llama, mistral,
            qwen2, qwen3, and the others of ``transformers.modeling_gguf_pytorch_utils``).
        cache_dir: folder to put the converted folder in; default :func:`default_cache_root`.

    Returns:
        Absolute path of the converted folder.

    Raises:
        ValueError: the path is missing, not a file, unreadable, not GGUF, of an architecture
            transformers cannot convert, truncated, or holding a tensor type radixserve cannot
            read (the message names the tensor).
        OSError: the cache folder cannot be written (e.g. disk full, read-only).
    """
    path = Path(gguf_path).expanduser()
    _check_gguf_file(path)
    path = path.resolve()
    target = converted_folder_path(path, cache_dir)
    if is_complete_folder(target):
        return target
    if target.exists():  # someone removed files from it, or a pre-rename crash on an odd FS
        logger.warning("discarding incomplete converted folder %s", target)
        _remove_tree(target, target.parent)

    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        logger.info("reading the config and tokenizer of %s (one time; cached at %s)",
                    path, target)
        start = time.perf_counter()
        info = _convert(path, tmp)
        for note in info.get("notes", ()):
            logger.warning("%s: %s", path.name, note)
        info["convert_seconds"] = round(time.perf_counter() - start, 2)
        (tmp / MARKER_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete_folder(target):
                raise
            # another process finished first; its folder is as good as ours
            _remove_tree(tmp, root)
        else:
            logger.info("converted %s in %.1f s", path.name, info["convert_seconds"])
    except BaseException:
        _remove_tree(tmp, root)
        raise
    return target


# --------------------------------------------------------------------------------------------
# conversion


_RESULT_FILE = ".convert-result.json"


def _convert(gguf_path: Path, out: Path) -> dict[str, Any]:
    """Write the Hugging Face files for ``gguf_path`` into the empty folder ``out`` in a child
    process, and return what it read (the marker's fields).

    Why a child: transformers' GGUF reader and tokenizer builder leave the process holding what
    they allocated (measured on a 32k-vocabulary GGUF: +160 MiB of RSS that neither
    ``gc.collect`` nor ``malloc_trim`` gives back, half of it modules imported on the way; a
    150k-vocabulary Qwen2.5 file peaks at 645 MiB while converting). In the serving process that
    memory would sit beside the weights for good; in a child it ends with it. The price is the
    child's imports (about 3 s), paid on the first start only.

    Raises:
        ValueError: as ``_convert_here``; the child's message is kept.
        OSError: the child could not write the folder.
        RuntimeError: the child died some other way (its stderr's tail is in the message).
    """
    code = ("import sys; from radixserve.model_executor.loader.gguf_loader import _child_main; "
            "_child_main(sys.argv[1], sys.argv[2])")
    proc = subprocess.run([sys.executable, "-c", code, str(gguf_path), str(out)],
                          capture_output=True, text=True, check=False)
    result_file = out / _RESULT_FILE
    try:
        result = json.loads(result_file.read_text())
    except (OSError, ValueError):
        raise RuntimeError(f"{gguf_path}: the conversion process exited with {proc.returncode}: "
                           f"{proc.stderr[-2000:]}") from None
    result_file.unlink()
    if "error" in result:
        kind = OSError if result["type"] == "OSError" else ValueError
        raise kind(result["error"])
    return result["info"]


def _child_main(gguf_path: str, out: str) -> None:
    """The conversion child's body: ``_convert_here`` and its result (or its ValueError or
    OSError message) as JSON in ``out/.convert-result.json``."""
    folder = Path(out)
    try:
        result: dict[str, Any] = {"info": _convert_here(Path(gguf_path), folder)}
    except (ValueError, OSError) as e:
        result = {"type": "OSError" if isinstance(e, OSError) else "ValueError", "error": str(e)}
    (folder / _RESULT_FILE).write_text(json.dumps(result))


def _convert_here(gguf_path: Path, out: Path) -> dict[str, Any]:
    """Write the Hugging Face files for ``gguf_path`` into the empty folder ``out``, in this
    process."""
    from transformers import GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        meta, tensor_types = _read_metadata(gguf_path)
    except Exception as e:  # struct.error, ValueError, UnicodeDecodeError, ... on a broken file
        raise ValueError(f"{gguf_path}: cannot read the GGUF metadata (truncated or corrupt "
                         f"file?): {type(e).__name__}: {e}") from e
    arch = meta.get("general.architecture", "?")
    notes: list[str] = []

    # --- weights: not copied. The runner reads them from the GGUF itself (``gguf_weights``)
    # into the serving dtype, a block of rows at a time. Only the table is checked, first
    # (transformers' config reader touches tensors), so that a truncated file or an unknown
    # type fails here, naming the tensor.
    from .gguf_weights import read_tensor_table

    _, table = read_tensor_table(gguf_path)
    n_params = sum(math.prod(t.shape) for t in table)

    # --- config
    try:
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise ValueError(f"{gguf_path}: transformers cannot convert this GGUF "
                         f"(architecture {arch!r}): {e}") from e
    config_dict = dict(parsed["config"])
    model_type = config_dict.get("model_type")
    if model_type not in CONFIG_MAPPING or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} (model_type {model_type!r}) "
                         "has no causal-LM class in transformers")
    _complete_config(config_dict, meta, arch, gguf_path, tensor_types, notes)
    config = CONFIG_MAPPING[model_type].from_dict(config_dict)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]

    # --- config.json
    config.save_pretrained(out)
    cfg_json = json.loads((out / "config.json").read_text())
    for key in ("_name_or_path", "_model_name_or_path"):  # the GGUF's general.name; see marker
        cfg_json.pop(key, None)
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")

    # --- tokenizer
    _write_tokenizer(gguf_path, out, meta, config)

    # --- generation_config.json: every end-of-generation id the GGUF names
    eos_ids = _gguf_eos_ids(meta, config)
    gen = GenerationConfig(
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_id=eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    gen.save_pretrained(out)

    st = gguf_path.stat()
    return {
        "source": str(gguf_path),
        "source_size": st.st_size,
        "source_mtime_ns": st.st_mtime_ns,
        "gguf_architecture": arch,
        "gguf_name": meta.get("general.name"),
        "gguf_file_type": meta.get("general.file_type"),
        "gguf_tensor_types": dict(Counter(tensor_types.values())),
        "model_type": model_type,
        "num_parameters": n_params,
        "eos_token_ids": eos_ids,
        "converter_version": CONVERTER_VERSION,
        "transformers_version": importlib.metadata.version("transformers"),
        "gguf_version": _package_version("gguf"),
        "notes": notes,
    }


def _write_tokenizer(gguf_path: Path, out: Path, meta: dict, config) -> None:
    """Save transformers' GGUF tokenizer into ``out`` and make ``tokenizer_config.json`` complete."""
    from transformers import AutoTokenizer

    # Load from a folder holding only (a link to) the GGUF, so that stray tokenizer files beside the
    # user's GGUF cannot leak in.
    src = out / "_gguf_src"
    src.mkdir()
    try:
        try:
            (src / gguf_path.name).symlink_to(gguf_path)
            src_dir = src
        except OSError:  # no symlinks on this file system
            src_dir = gguf_path.parent
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(src_dir), gguf_file=gguf_path.name)
        except Exception as e:  # transformers raises many types here
            raise ValueError(f"{gguf_path}: cannot build a tokenizer from the GGUF metadata: "
                             f"{type(e).__name__}: {e}") from e
    finally:
        shutil.rmtree(src, ignore_errors=True)

    chat_template = meta.get("tokenizer.chat_template")
    if chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    max_len = getattr(config, "max_position_embeddings", None)
    if max_len:
        tokenizer.model_max_length = int(max_len)
    tokenizer.save_pretrained(str(out))

    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    for key in ("is_local", "local_files_only", "name_or_path", "_commit_hash"):
        tc.pop(key, None)
    if tokenizer.chat_template:
        tc["chat_template"] = tokenizer.chat_template
    for gguf_key, key in (("tokenizer.ggml.add_bos_token", "add_bos_token"),
                          ("tokenizer.ggml.add_eos_token", "add_eos_token")):
        if isinstance(meta.get(gguf_key), bool):
            tc.setdefault(key, meta[gguf_key])
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    special = {k: v for k, v in tokenizer.special_tokens_map.items() if v is not None}
    (out / "special_tokens_map.json").write_text(
        json.dumps(special, indent=2, sort_keys=True, ensure_ascii=False) + "\n")

    # Self-check: the saved folder must tokenize like the GGUF tokenizer.
    reloaded = AutoTokenizer.from_pretrained(str(out))
    probe = "Hello world! 1234 — naïve café 🙂 你好"
    if reloaded.encode(probe) != tokenizer.encode(probe):
        raise ValueError(f"{gguf_path}: the saved tokenizer does not round-trip")


def _complete_config(config_dict: dict, meta: dict, arch: str, gguf_path: Path,
                     tensor_types: dict[str, int], notes: list[str]) -> None:
    """Add what transformers' GGUF config mapping leaves out, in place.

    * ``head_dim`` from ``<arch>.attention.key_length`` (Qwen3 heads are 128 wide whatever
      hidden_size / num_heads is; transformers otherwise takes the config class default);
    * RoPE scaling: ``<arch>.rope.scaling.*`` (linear, yarn), and Llama-3.1-style scaling, which
      llama.cpp stores only as the ``rope_freqs.weight`` tensor (reconstructed when its values match
      the llama3 formula; else noted).
    """
    # llama.cpp attends to every earlier token unless the file names a window; a config class's
    # default window (MistralConfig's 4096) must not stand in for one the file does not have
    window = meta.get(f"{arch}.attention.sliding_window")
    config_dict["sliding_window"] = window if isinstance(window, int) and window > 0 else None
    key_length = meta.get(f"{arch}.attention.key_length")
    if isinstance(key_length, int) and key_length > 0 and config_dict.get("head_dim") != key_length:
        config_dict["head_dim"] = key_length
    value_length = meta.get(f"{arch}.attention.value_length")
    if isinstance(value_length, int) and isinstance(key_length, int) and value_length != key_length:
        notes.append(f"value head size {value_length} != key head size {key_length}")

    theta = config_dict.get("rope_theta", meta.get(f"{arch}.rope.freq_base", 10000.0))
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if scaling_type in ("linear", "yarn") and isinstance(factor, (int, float)) and factor > 1:
        rope = {"rope_type": scaling_type, "factor": float(factor), "rope_theta": theta}
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if scaling_type == "yarn" and isinstance(orig, int) and orig > 0:
            rope["original_max_position_embeddings"] = orig
        config_dict["rope_scaling"] = rope
    elif scaling_type not in (None, "none"):
        notes.append(f"RoPE scaling {scaling_type!r} (factor {factor}) is not carried over")

    if "rope_freqs.weight" in tensor_types:
        freqs = _read_f32_tensor(gguf_path, "rope_freqs.weight")
        head_dim = config_dict.get("head_dim") or (
            config_dict["hidden_size"] // config_dict["num_attention_heads"])
        rope = _llama3_rope_from_factors(freqs, theta, head_dim) if freqs is not None else None
        if rope is not None:
            config_dict["rope_scaling"] = rope
        else:
            notes.append("rope_freqs.weight holds RoPE factors that match no known scaling; "
                         "they are ignored (outputs may differ from llama.cpp)")


def _llama3_rope_from_factors(factors, theta: float, head_dim: int) -> dict | None:
    """The ``rope_type: llama3`` parameters whose per-frequency factors equal ``factors``.

    llama.cpp's converter turns HF's llama3 rope scaling into one factor per frequency pair
    (``rope_freqs.weight``); every released Llama 3.x uses low/high frequency factors 1 and 4 and an
    original context of 8192, so only ``factor`` (the largest value) is unknown. Returns None when
    the recomputed factors do not match (rtol 1e-4).
    """
    factors = [float(x) for x in factors]
    if len(factors) != head_dim // 2 or not factors:
        return None
    factor, low, high, orig = max(factors), 1.0, 4.0, 8192
    low_wavelen, high_wavelen = orig / low, orig / high
    expected = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / (theta ** (i / head_dim))
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            expected.append(1.0)
        elif wavelen > low_wavelen:
            expected.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            expected.append(1.0 / ((1 - smooth) / factor + smooth))
    if all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(factors, expected, strict=True)):
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": orig,
                "rope_theta": theta}
    return None


def _gguf_eos_ids(meta: dict, config) -> list[int]:
    """End-of-generation ids: eos, then llama.cpp's eot / eom ids when the GGUF names them."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if isinstance(value, int) and value >= 0 and value not in ids:
            ids.append(value)
    if not ids:
        eos = getattr(config, "eos_token_id", None)
        ids = [eos] if isinstance(eos, int) else list(eos or [])
    return ids


# --------------------------------------------------------------------------------------------
# reading


def _read_metadata(gguf_path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """``(metadata, {tensor name: ggml type})``, string arrays left as their length.

    Uses transformers' header reader (milliseconds) and falls back to ``gguf.GGUFReader`` (seconds:
    it builds a numpy view per vocabulary entry) on transformers versions without it.
    """
    try:
        from transformers.integrations.gguf import GgufHeader, read_gguf_metadata
    except ImportError:
        return _read_metadata_gguf_py(gguf_path)
    try:
        meta, _ = read_gguf_metadata(str(gguf_path))
        header = GgufHeader.from_file(str(gguf_path))
    except (ValueError, KeyError) as e:
        # e.g. a ggml type this reader does not know; gguf-py may still read the file
        logger.debug("transformers' GGUF header reader failed (%s); using gguf-py", e)
        return _read_metadata_gguf_py(gguf_path)
    return meta, {t.name: t.ggml_type for t in header.tensors}


def _read_metadata_gguf_py(gguf_path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            value = field.contents()
        except Exception:  # noqa: BLE001 - an exotic field type; not one we need
            continue
        if isinstance(value, list) and value and isinstance(value[0], str):
            value = len(value)
        meta[key] = value
    return meta, {t.name: int(t.tensor_type) for t in reader.tensors}


def _read_f32_tensor(gguf_path: Path, name: str) -> list[float] | None:
    """A small float32 tensor of the file as a list, or None if it cannot be read that way."""
    try:
        from transformers.integrations.gguf import GgufHeader, load_gguf_state_dict

        header = GgufHeader.from_file(str(gguf_path))
        info = next((t for t in header.tensors if t.name == name), None)
        if info is None or info.ggml_type != 0:  # 0: GGML F32
            return None
        return [float(x) for x in load_gguf_state_dict(header)[name][...].reshape(-1)]
    except ImportError:
        pass
    except Exception as e:  # noqa: BLE001 - reported by the caller as "unknown factors"
        logger.debug("cannot read %s from %s: %s", name, gguf_path, e)
        return None
    try:
        from gguf import GGMLQuantizationType, GGUFReader

        for t in GGUFReader(str(gguf_path)).tensors:
            if t.name == name and t.tensor_type == GGMLQuantizationType.F32:
                return [float(x) for x in t.data.reshape(-1)]
    except Exception as e:  # noqa: BLE001
        logger.debug("cannot read %s from %s: %s", name, gguf_path, e)
    return None


def _check_gguf_file(path: Path) -> None:
    if not path.exists():
        raise ValueError(f"GGUF file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"{path} is not a file; expected a .gguf file")
    try:
        ok = is_gguf_file(path)
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from e
    if not ok:
        raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _remove_tree(path: Path, root: Path) -> None:
    """rmtree ``path`` after renaming it aside, so a reader never sees it half-deleted."""
    if not path.exists():
        return
    trash = None
    try:
        trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=root))
        os.rename(path, trash / "x")
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _remove_stale_tmp_dirs(root: Path) -> None:
    """Delete temp folders that crashed or killed conversions left behind (older than 6 h)."""
    now = time.time()
    try:
        entries = list(root.iterdir())
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(".") or not (".tmp-" in entry.name
                                                  or entry.name.startswith(".trash-")):
            continue
        try:
            if now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue


def export_hf_weights(gguf_path: Path, dtype: str = "float32",
                      cache_dir: Path | None = None) -> Path:
    """A full Hugging Face folder (config, tokenizer and dequantized safetensors weights) of a
    GGUF file, for peers that load only such folders (transformers, vLLM in the benchmarks);
    radixserve itself never needs it.

    Written once next to the converted folder (``<converted>-<dtype>``), streamed one tensor at
    a time into safetensors shards of at most 2 GB, and reused.

    Args:
        gguf_path: the GGUF file.
        dtype: "float32", "bfloat16" or "float16": the weights' dtype in the folder.
        cache_dir: as in :func:`gguf_to_hf_folder`.

    Returns:
        The folder's absolute path.

    Raises:
        ValueError: as :func:`gguf_to_hf_folder`, or an unknown dtype.
        OSError: the cache cannot be written.
    """
    import torch
    from safetensors.torch import save_file

    from .gguf_weights import iter_gguf_weights

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in dtypes:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(dtypes)}")
    meta_folder = gguf_to_hf_folder(gguf_path, cache_dir)
    target = meta_folder.parent / f"{meta_folder.name}-{dtype}"
    if (target / "model.safetensors.index.json").is_file():
        return target
    cfg = json.loads((meta_folder / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=meta_folder.parent))
    try:
        for f in meta_folder.iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        cfg["torch_dtype"] = cfg["dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        weight_map: dict[str, str] = {}
        shard: dict[str, torch.Tensor] = {}
        shard_bytes, total, n_shard = 0, 0, 0

        def flush() -> None:
            nonlocal shard, shard_bytes, n_shard
            if shard:
                n_shard += 1
                name = f"model-{n_shard:05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, name))
                shard, shard_bytes = {}, 0

        tied = bool(cfg.get("tie_word_embeddings"))
        for name, lazy in iter_gguf_weights(Path(gguf_path).resolve(), heads, kv_heads):
            if tied and name == "lm_head.weight":
                continue
            t = lazy.full().to(dtypes[dtype])
            if shard_bytes + t.nbytes > 2 << 30:
                flush()
            shard[name] = t
            shard_bytes += t.nbytes
            total += t.nbytes
        flush()
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors.index.json").is_file():
                raise
            _remove_tree(tmp, meta_folder.parent)
    except BaseException:
        _remove_tree(tmp, meta_folder.parent)
        raise
    return target
