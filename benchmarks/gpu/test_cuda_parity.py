"""Golden parity on CUDA: radixserve's greedy tokens against transformers' on the same tiny
random-weight Llama / Qwen2 / Qwen3 checkpoints (tests/integration/tiny_models.py), both on the
GPU, for each attention backend ("torch", "triton"), eagerly (``enforce_eager=True``) and with
decode steps replayed from CUDA graphs (the default), in float32 and in bfloat16; one GPU
(``tensor_parallel_size=1``). Speculative decoding (n-gram and draft-model proposers, the verify
step over the paged KV) is checked the same way: its greedy tokens against transformers'.

Kept out of ``make test`` (which collects tests/ only): it needs a GPU. benchmarks/gpu/run.sh
runs it on the device machine. Criterion: tests/integration/test_parity.py's ``assert_close``
(identical tokens, or a near-tie at the first divergence: each side's token in the other's
top-5 logprobs). With ``RADIXSERVE_GPU_TEST_DEVICE=cpu`` the same tests run on CPU (a check of
this file, not of CUDA: nothing is captured there). ``RADIXSERVE_GPU_PARITY_LOG=PATH`` appends
one JSON line per test (prompts matched exactly / by near-tie, graph replays).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "integration"))

from test_parity import greedy_parity  # noqa: E402
from tiny_models import TINY_VOCAB, tiny_model  # noqa: E402

from radixserve import LLM  # noqa: E402
from radixserve.config import ATTENTION_BACKENDS  # noqa: E402

DEVICE = os.environ.get("RADIXSERVE_GPU_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
if ON_CUDA and not torch.cuda.is_available():
    pytest.skip("CUDA is not available (RADIXSERVE_GPU_TEST_DEVICE=cpu checks this file on CPU)",
                allow_module_level=True)

#: prompt lengths: short ones, and ones longer than the step budget (prefilled in chunks)
PROMPT_LENS = (3, 9, 33, 70, 130)
NEW_TOKENS = 24


def _log(record: dict) -> None:
    path = os.environ.get("RADIXSERVE_GPU_PARITY_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _free(llm: LLM | None) -> None:
    if llm is not None:
        llm.engine.shutdown()
    gc.collect()
    if ON_CUDA:
        torch.cuda.empty_cache()


def _spec_prompts(rng: np.random.Generator) -> list[list[int]]:
    """Prompts that repeat a short phrase (n-gram prompt lookup finds drafts in them) beside
    random ones."""
    out = []
    for i, n in enumerate(PROMPT_LENS):
        phrase = rng.integers(3, TINY_VOCAB, size=int(rng.integers(2, 6))).tolist()
        out.append((phrase * n)[:n] if i % 2 == 0 else rng.integers(3, TINY_VOCAB, n).tolist())
    return out


def run_parity(tmp_path: Path, arch: str, backend: str, mode: str, dtype: str,
               spec: str | None = None) -> None:
    """``NEW_TOKENS`` greedy tokens of each prompt, batched in radixserve, against transformers'
    of each alone, on ``DEVICE`` in ``dtype``; asserts the backend and the graph mode ran.
    ``spec`` ("ngram" or "draft_model", the model as its own draft) speculates with 3 draft
    tokens in every step (no batch-size cap), checking the pool's integrity after each step,
    and asserts that drafts were verified (and, for the draft model, accepted)."""
    from transformers import AutoModelForCausalLM

    if backend not in ATTENTION_BACKENDS:
        pytest.skip(f"attention_backend {backend!r} is not in this tree's {ATTENTION_BACKENDS}")
    torch_dtype = getattr(torch, dtype)
    path = tiny_model(tmp_path, arch)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = ref.to(device=DEVICE, dtype=torch_dtype).eval()
    llm = None
    spec_config = None
    if spec == "ngram":
        spec_config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 3, "disable_by_batch_size": None,
                       "adaptive_draft_length": False}
    elif spec == "draft_model":
        spec_config = {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
                       "disable_by_batch_size": None, "adaptive_draft_length": False}
    try:
        llm = LLM(model=path, device=DEVICE, dtype=dtype, attention_backend=backend,
                  enforce_eager=mode == "eager", tensor_parallel_size=1, page_size=4,
                  num_pages=256, max_num_seqs=16, max_model_len=256, seed=0,
                  max_num_batched_tokens=48,  # small budget: long prompts prefill in chunks
                  speculative_config=spec_config)
        if spec is not None:
            llm.engine.check_integrity_each_step = True
        runner = llm.engine.runner
        assert runner.attention_backend == backend, runner.paths.paths
        assert str(runner.dtype) == f"torch.{dtype}"
        replays = []
        if ON_CUDA:
            if mode == "eager":
                assert runner.graphs is None, runner.paths.paths
            else:  # a failed capture falls back to eager with a warning: not accepted here
                assert runner.graphs is not None, runner.paths.fallbacks
                graph_run = runner.graphs.run
                runner.graphs.run = lambda b: (replays.append(b.num_requests), graph_run(b))[1]
        rng = np.random.default_rng(7)
        prompts = ([rng.integers(3, TINY_VOCAB, size=n).tolist() for n in PROMPT_LENS]
                   if spec is None else _spec_prompts(rng))
        exact = greedy_parity(llm, ref, prompts, NEW_TOKENS,
                              f"{arch} {backend} {mode} {dtype} spec={spec} prompt")
        if ON_CUDA and mode == "graphs" and spec is None:
            # 5 decodes fill no bucket exactly: the replays ran padded rows too
            assert replays, "no decode step was replayed from a CUDA graph"
        record = {"arch": arch, "backend": backend, "mode": mode, "dtype": dtype,
                  "device": DEVICE, "prompts": len(prompts), "exact": exact,
                  "graph_replays": len(replays), "paths": dict(runner.paths.paths)}
        if spec is not None:
            counts = llm.engine.get_stats().spec_decode
            assert counts is not None and counts.num_draft_tokens > 0, counts
            if spec == "draft_model":  # its own draft: its picks are the target's
                assert counts.num_accepted_tokens > 0, counts
            record.update(spec=spec, draft_tokens=counts.num_draft_tokens,
                          accepted_tokens=counts.num_accepted_tokens)
        _log(record)
    finally:
        del ref
        _free(llm)


@pytest.mark.parametrize("mode", ["eager", "graphs"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_float32_parity(tmp_path: Path, arch: str, backend: str, mode: str) -> None:
    run_parity(tmp_path, arch, backend, mode, "float32")


@pytest.mark.parametrize("mode", ["eager", "graphs"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_bfloat16_near_tie_parity(tmp_path: Path, arch: str, backend: str, mode: str) -> None:
    """bf16 against transformers' own bf16 forward: greedy tokens equal but for near-ties
    (``assert_close`` on every prompt; how many were exact goes to the log)."""
    run_parity(tmp_path, arch, backend, mode, "bfloat16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_speculative_decoding_parity(tmp_path: Path, spec: str, backend: str, dtype: str
                                     ) -> None:
    """The verify step on the GPU: k + 1 query rows per speculating request over the paged KV,
    beside decodes and prefill chunks, CUDA graphs on for the plain decode steps."""
    run_parity(tmp_path, "qwen2", backend, "graphs", dtype, spec)
