"""The CUDA-graph decode path's buffers and padding, run eagerly on CPU (``capture=False``):
decode steps copied into static buffers and padded to a bucket give the tokens and logprobs of
the ordinary path. The capture itself needs CUDA (see docs/benchmarks.md for where it ran)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tiny_models import TINY_VOCAB, tiny_model

from radixserve import LLM, SamplingParams
from radixserve.model_executor.cuda_graphs import DecodeGraphs, graph_buckets


class CountingGraphs(DecodeGraphs):
    """Counts the steps it ran and the padded rows it added."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.steps = 0
        self.padded_rows = 0

    def run(self, batch):  # noqa: ANN001, ANN201
        self.steps += 1
        self.padded_rows += self.bucket(batch.num_requests) - batch.num_requests
        return super().run(batch)


def test_buckets() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(20) == [1, 2, 4, 8, 12, 16, 20]
    assert graph_buckets(256)[-3:] == [192, 224, 256]
    with pytest.raises(ValueError, match="cuda_graph_max_bs=0"):
        graph_buckets(0)


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_padded_static_decode_equals_eager(tmp_path: Path, backend: str,
                                           request: pytest.FixtureRequest) -> None:
    if backend == "triton":
        request.getfixturevalue("triton_attention")  # its kernels in Triton's interpreter
    path = tiny_model(tmp_path, "qwen2", 0.2)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, TINY_VOCAB, size=n).tolist() for n in (2, 7, 19, 40, 5)]
    # Triton's interpreter runs each kernel launch in Python (seconds per step): fewer steps
    # there, still several padded decode steps (5 requests in the bucket of 8)
    max_tokens = 5 if backend == "triton" else 12
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)

    def generate(graphs: bool) -> tuple[list, CountingGraphs | None]:
        llm = LLM(model=path, dtype="float32", page_size=4, num_pages=128,
                  attention_backend=backend, max_num_seqs=8)
        runner = llm.engine.runner
        g = None
        if graphs:
            # max_pages 16 (64 tokens) > any sequence here; 5 requests pad to the bucket 8
            g = runner.graphs = CountingGraphs(runner.model, runner.kv.layers, 4, 16,
                                               [1, 2, 4, 8], runner.attention_backend,
                                               capture=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return outs, g

    want, _ = generate(False)
    got, g = generate(True)
    assert g is not None and g.steps >= max_tokens - 1 and g.padded_rows > 0
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)
