"""Settings shared by every test: nothing is downloaded, tokenizers stay single-threaded.

Unit tests (tests/unit, `make test-unit`) must not load the real default model or its tokenizer;
the fixtures that do (the model, the transformers reference, the shared real server) live in
tests/integration/conftest.py."""

from __future__ import annotations

import os

from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# No test asserts a duration: hypothesis' per-example deadline (200 ms by default) would, on a
# loaded 2-core CI machine. Speed belongs in the benchmarks.
settings.register_profile("radixserve", deadline=None)
settings.load_profile("radixserve")
