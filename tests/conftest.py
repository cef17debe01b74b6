"""Settings shared by every test: nothing is downloaded, tokenizers stay single-threaded.

Unit tests (tests/unit, `make test-unit`) must not load the real default model or its tokenizer;
the fixtures that do (the model, the transformers reference, the shared real server) live in
tests/integration/conftest.py."""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _import_triton_interpreted() -> None:
    """Import triton (when installed) with ``TRITON_INTERPRET=1``, then restore the variable.

    Triton fixes, per ``@triton.jit`` function when it is defined, whether it is interpreted;
    its own library functions (``tl.sum``, ``tl.cdiv``, ...) are defined when triton is first
    imported, and torch imports it as a side effect (``torch._dynamo``, which transformers
    loads). Imported first here, they stay interpreted, so radixserve's Triton kernels can run
    on CPU tensors in the ``triton_attention`` fixture; no other test or server subprocess
    sees the variable."""
    if "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module("triton.language")
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


_import_triton_interpreted()

# No test asserts a duration: hypothesis' per-example deadline (200 ms by default) would, on a
# loaded 2-core CI machine. Speed belongs in the benchmarks.
settings.register_profile("radixserve", deadline=None)
settings.load_profile("radixserve")


def _import_interpreted(name: str):  # noqa: ANN202
    """Import radixserve module ``name`` with ``TRITON_INTERPRET=1`` (its kernels interpreted,
    like triton's own functions: ``_import_triton_interpreted``), then restore the variable.
    Skips when triton is not installed (it is in the ``test`` extra)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module(name)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    if not module.INTERPRETED:
        pytest.fail(f"{name} was imported in this process without TRITON_INTERPRET=1: its "
                    "kernels are compiled for a GPU and cannot run on CPU tensors")
    return module


@pytest.fixture(scope="session")
def _triton_interpreted():
    """radixserve's Triton attention module, its kernels interpreted."""
    return _import_interpreted("radixserve.model_executor.attention.triton_attention")


@pytest.fixture(scope="session")
def _triton_ops_interpreted():
    """radixserve's Triton layer kernels (``kernels.triton_ops``), interpreted."""
    return _import_interpreted("radixserve.model_executor.kernels.triton_ops")


@pytest.fixture
def triton_layer_ops(_triton_ops_interpreted, monkeypatch: pytest.MonkeyPatch):
    """``kernels.triton_ops`` with its kernels in Triton's interpreter, so they run on CPU
    tensors (``TRITON_INTERPRET`` set for the test's duration, as ``triton_attention``)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return _triton_ops_interpreted


@pytest.fixture
def triton_attention(_triton_interpreted, monkeypatch: pytest.MonkeyPatch):
    """radixserve's Triton attention module with its kernels in Triton's interpreter, so they
    run on CPU tensors. The interpreter also reads ``TRITON_INTERPRET`` while kernels run, so
    it is set for the duration of the test (and of no other)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return _triton_interpreted


@pytest.fixture(scope="session")
def _kernel_builds() -> Path:
    """The folder of this machine's C kernel builds (built here if missing), resolved before
    any test points ``RADIXSERVE_CACHE_DIR`` elsewhere."""
    from radixserve.model_executor.kernels.cpu import build

    return build().parent


@pytest.fixture
def seed_kernel_cache(_kernel_builds: Path):
    """``seed(root)`` copies the machine's C kernel builds into the cache root ``root`` (a
    test's own ``RADIXSERVE_CACHE_DIR``). Tests that isolate the cache do so for measurements
    and conversions; without the builds, each would compile the kernels again (seconds of
    ``cc`` per test). The build itself is tested in tests/unit/test_cpu_kernels.py."""
    def seed(root: Path) -> None:
        dst = Path(root) / "kernels"
        dst.mkdir(parents=True, exist_ok=True)
        for so in _kernel_builds.glob("cpu_kernels-*.so"):
            shutil.copy2(so, dst / so.name)

    return seed
