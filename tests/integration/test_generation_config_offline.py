"""The offline ``LLM`` with ``generation_config`` (vLLM's argument) on the default model: the
folder's sampling defaults are what ``get_default_sampling_params`` returns and what
``generate`` samples with when given no ``SamplingParams``."""

from __future__ import annotations

import json
from pathlib import Path

from radixserve import LLM, SamplingParams


def test_offline_defaults_from_a_generation_config_folder(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 6, "top_p": 0.8}))
    llm = LLM(dtype="float32", num_pages=64, generation_config=str(tmp_path))
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.max_tokens, sp.top_p, sp.top_k) == (0.0, 6, 0.8, -1)
    prompt = "The capital of France is"
    (out,) = llm.generate([prompt], use_tqdm=False)
    (greedy,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6),
                             use_tqdm=False)
    # greedy (temperature 0 from the folder), 6 tokens (its max_new_tokens)
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert len(out.outputs[0].token_ids) == 6
