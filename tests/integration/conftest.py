"""Fixtures for tests against the real default model. Expensive things load once per session:
the offline ``LLM``, the transformers reference and one ``radixserve serve`` process, shared by
every test that can use them (tests that kill or reconfigure a server start their own)."""

from __future__ import annotations

import pytest
from server_utils import ServerProcess

#: Engine flags of the shared default-model server: a small KV pool keeps memory low; step
#: timers on, so the benchmark tests can read them from /metrics.
SERVER_ARGS = ["--num-pages", "640", "--max-num-seqs", "96", "--seed", "0", "--step-timers"]


@pytest.fixture(scope="session")
def default_llm():
    """The default model (SmolLM2-135M-Instruct), float32, radixserve's offline LLM, its Q4_1
    file dequantized (the dense path, compared with transformers' own dequantization; the
    block path has its own tests against llama.cpp, test_quantized_default.py)."""
    from radixserve import LLM

    return LLM(dtype="float32", seed=0, quantization="none")


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


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    """One default-model server for the whole session (the model loads once)."""
    srv = ServerProcess(SERVER_ARGS, tmp_path_factory.mktemp("server"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
