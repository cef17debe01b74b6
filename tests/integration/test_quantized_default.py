"""The default model's own Q4_1 file served in its blocks (``--quantization gguf``) against an
independent reference: llama.cpp's logprobs on the same file and the same 2,048 token ids, kept
as a golden file written by ``benchmarks/golden/llama_cpp_logprobs.py`` (llama-cpp-python
0.3.36, named in the file)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from radixserve import LLM, SamplingParams

GOLDEN = Path(__file__).with_name("golden") / "llama_cpp_smollm2_q4_1.json"


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def _logprobs(llm: LLM, ids: list[int]) -> list[float]:
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return [lp[t] for lp, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]


def test_default_q4_1_perplexity_matches_llama_cpp(golden):
    """Perplexity over 2,048 tokens within 1% of llama.cpp's on the same file, served in
    blocks; per-token logprobs close to it (both quantize activations to 8 bits per block,
    in different orders)."""
    from radixserve.model_executor.loader import resolve_model

    model = resolve_model(None).gguf
    assert model is not None and model.name == golden["model_file"]
    assert model.stat().st_size == golden["model_bytes"]
    ids = golden["token_ids"]
    llm = LLM(dtype="float32", max_model_len=len(ids) + 8, num_pages=160,
              quantization="gguf", enable_prefix_caching=False)
    assert llm.engine.runner.paths.paths["quantization"] == "gguf"
    assert llm.engine.runner.model.layers[0].quantized["qkv"].kind == "Q4_1"
    ours = _logprobs(llm, ids)
    ref = golden["logprobs"]
    ppl = math.exp(-sum(ours) / len(ours))
    assert abs(ppl / golden["perplexity"] - 1) < 0.01, (ppl, golden["perplexity"])
    diffs = sorted(abs(a - b) for a, b in zip(ours, ref, strict=True))
    # Measured (AVX2 kind): perplexity 42.97 against llama.cpp's 43.02 (0.12%), the median
    # token 0.050 nats apart. llama.cpp keeps K/V in float16 and rounds differently: the same
    # file served dense in float32 (no activation rounding at all) is itself 0.043 nats from
    # it at the median. A kernel error (a wrong scale, nibble order or row) moves every token
    # by far more than the 0.1 allowed here.
    assert diffs[len(diffs) // 2] < 0.1, diffs[len(diffs) // 2]
