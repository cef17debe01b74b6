"""The engine flags of every command line (``radixserve serve``, ``generate``, ``bench``):
one flag per ``EngineConfig`` field, generated from the dataclass, and byte sizes like 4GiB."""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable

from radixserve.config import (
    ATTENTION_BACKENDS,
    BF16_GEMMS,
    DTYPES,
    QUANTIZATIONS,
    SCHEDULE_POLICIES,
    EngineConfig,
    KVTransferConfig,
    SpeculativeConfig,
)

_SIZE = re.compile(r"^\s*([\d.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """"4GiB", "512MB", "1000000" -> bytes. Raises argparse.ArgumentTypeError."""
    m = _SIZE.match(text)
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4GiB, 512MB)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


_CHOICES = {"dtype": DTYPES, "schedule_policy": SCHEDULE_POLICIES,
            "attention_backend": ATTENTION_BACKENDS, "quantization": QUANTIZATIONS,
            "cpu_bf16_gemm": BF16_GEMMS}
_ALIASES = {"enable_prefix_caching": ["--no-prefix-caching", "--no-prefix-cache"]}
#: vLLM's short spellings
_SHORT = {"tensor_parallel_size": ["-tp"]}
_HELP = {"kv_transfer_config": "prefill/decode disaggregation as vLLM's JSON, e.g. "
         '\'{"kv_connector":"NixlConnector","kv_role":"kv_both"}\' (see KVTransferConfig)',
         "generation_config": "sampling defaults for requests that leave them unset: auto "
         "(the model's generation_config.json), vllm (none), or a folder holding one "
         "(default auto)",
         "speculative_config": "speculative decoding as vLLM's JSON, e.g. "
         '\'{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4,'
         '"prompt_lookup_min":2}\' or \'{"method":"draft_model","model":PATH,'
         '"num_speculative_tokens":3}\' (sampled requests by rejection sampling; see '
         'SpeculativeConfig)'}


def parse_kv_transfer_config(text: str) -> KVTransferConfig:
    """``--kv-transfer-config`` JSON -> ``KVTransferConfig``; argparse reports the error."""
    try:
        return KVTransferConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config`` JSON -> ``SpeculativeConfig``; argparse reports the error."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_CONVERTERS: dict[str, Callable[[str], object]] = {
    "kv_cache_memory": parse_bytes, "kv_transfer_config": parse_kv_transfer_config,
    "speculative_config": parse_speculative_config}


def add_engine_args(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One flag per ``EngineConfig`` field (``page_size`` -> ``--page-size``)."""
    hints = typing.get_type_hints(EngineConfig)
    g = p.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        t = hints[f.name]
        args = typing.get_args(t)
        base = next((a for a in args if a is not type(None)), t) if (
            typing.get_origin(t) in (typing.Union, types.UnionType)) else t
        if base is bool:
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=f.default)
            for alias in _ALIASES.get(f.name, []):
                g.add_argument(alias, dest=f.name, action="store_false", help=argparse.SUPPRESS)
            continue
        conv: Callable[[str], object] = _CONVERTERS.get(f.name, base)
        g.add_argument(flag, *_SHORT.get(f.name, []), dest=f.name, type=conv, default=f.default,
                       choices=_CHOICES.get(f.name), help=_HELP.get(f.name))


def engine_config_from_args(ns: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` from parsed flags (fields without a flag keep their defaults).

    Raises:
        ValueError: a field out of range (``EngineConfig.validate``).
    """
    kw = {n: getattr(ns, n) for n in EngineConfig.field_names() if hasattr(ns, n)}
    return EngineConfig(**kw)
