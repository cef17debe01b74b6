"""Shared fixtures. Expensive things (the default model, the transformers reference) load once
per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_llm():
    """The default model (SmolLM2-135M-Instruct), float32, radixserve's offline LLM."""
    from radixserve import LLM

    return LLM(dtype="float32", seed=0)


@pytest.fixture(scope="session")
def hf_reference():
    """transformers' own float32 load of the default GGUF file (its GGUF support, not our
    converter) and its tokenizer: the golden reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixserve.model_executor.loader.default import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tok
