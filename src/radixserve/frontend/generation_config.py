"""The model's recommended sampling defaults (``--generation-config``, vLLM's flag): the
values of ``generation_config.json`` that a request leaving the field unset gets instead of
vLLM's and OpenAI's defaults (temperature 1.0 and so on).

As in vLLM, only ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` (as ``max_tokens``) are read, and only where they differ from Hugging Face's
own ``GenerationConfig`` defaults (vLLM reads ``GenerationConfig.to_diff_dict()``): a file
that spells out ``"top_k": 50`` recommends nothing. ``do_sample`` is not read (vLLM does not
either).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from radixserve.sampling_params import SamplingParams

log = logging.getLogger("radixserve.frontend")

#: ``generation_config.json`` key -> ``SamplingParams`` field.
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "max_new_tokens": "max_tokens"}
#: Hugging Face ``GenerationConfig``'s defaults: a value equal to one is not a recommendation.
_HF_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                                "repetition_penalty": 1.0}


def sampling_defaults(generation_config: str, model_folder: str | Path) -> dict[str, Any]:
    """The sampling defaults ``--generation-config`` names, as ``SamplingParams`` fields.

    Args:
        generation_config: "auto" (the model folder's ``generation_config.json``; none there
            recommends nothing), "vllm" (nothing: the server's own defaults), or a folder
            holding a ``generation_config.json``.
        model_folder: the served model's folder (a GGUF's extracted folder).

    Returns:
        e.g. ``{"temperature": 0.6, "top_p": 0.9, "max_tokens": 256}``; empty for "vllm".

    Raises:
        ValueError: the folder given has no ``generation_config.json``, or a file that is not
            a JSON object, or a value of the wrong type (naming the file and key).
    """
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        path = Path(model_folder) / "generation_config.json"
        if not path.is_file():
            return {}
    else:
        path = Path(generation_config) / "generation_config.json"
        if not path.is_file():
            raise ValueError(f"generation_config={generation_config!r}: no "
                             f"generation_config.json in that folder (or use auto or vllm)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read it as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    out: dict[str, Any] = {}
    for key, field in SAMPLING_KEYS.items():
        value = data.get(key)
        if value is None or _HF_DEFAULTS.get(key) == value:
            continue
        integral = key in ("top_k", "max_new_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            raise ValueError(f"{path}: {key}={value!r} must be "
                             f"{'an integer' if integral else 'a number'}")
        if key == "top_k" and value == 0:
            value = -1  # Hugging Face's "no top-k"
        out[field] = value if integral else float(value)
    try:
        SamplingParams(**out)  # a value out of range fails at start-up, not in every request
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return out


def log_sampling_defaults(defaults: dict[str, Any], generation_config: str) -> None:
    """The start-up line saying which defaults requests get (vLLM logs the same warning)."""
    if defaults:
        log.info("sampling defaults from the model's generation config (--generation-config "
                 "%s; `--generation-config vllm` ignores them): %s", generation_config,
                 ", ".join(f"{k}={v}" for k, v in defaults.items()))
    else:
        log.info("sampling defaults: the server's own (--generation-config %s found none)",
                 generation_config)
