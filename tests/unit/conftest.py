"""Unit-test fixtures. Unit tests never load model weights: the default model's tokenizer is
read straight from its GGUF file's metadata (no weight conversion, a few seconds)."""

from __future__ import annotations

import pytest


def default_tokenizer():
    """The default model's tokenizer from the GGUF metadata (transformers' own GGUF reader;
    the same vocabulary, merges, special tokens and chat template as the converted folder)."""
    from transformers import AutoTokenizer

    from radixserve.model_executor.loader.default import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def tok():
    """``default_tokenizer()``, loaded once per session."""
    return default_tokenizer()
