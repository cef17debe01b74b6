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


def _cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo").read().splitlines():  # noqa: SIM115 - small file
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


#: the C kernel builds the kernel tests run: this CPU's own, and on a CPU with AVX-512 also a
#: ``-march=haswell`` build, so CI on either kind exercises the AVX2 kind's code paths too
#: (an AVX2-only CPU's own build is already those)
KERNEL_BUILDS = ["native"] + (["haswell"] if {"avx512f", "avx2", "fma"} <= _cpu_flags() else [])


@pytest.fixture(scope="module", params=KERNEL_BUILDS)
def kernel_build(request) -> str:
    """The ``-march`` of the kernel build under test (``KERNEL_BUILDS``)."""
    return request.param
