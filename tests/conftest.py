"""Settings shared by every test: nothing is downloaded, tokenizers stay single-threaded.

Unit tests (tests/unit) never load the real default model or its tokenizer; fixtures that do
(the model, the transformers reference, a real server) live in tests/integration/conftest.py."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
