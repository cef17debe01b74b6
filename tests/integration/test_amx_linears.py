"""A model's linears on radixserve's AMX bfloat16 GEMM (``layers/amx_linear.py``): on the AMX
kind the engine picks it for bfloat16 (``linear`` path "amx"); anywhere else the kernel's scalar
emulation of the tile instruction runs the same code, so the model-level promises are tested on
every kind: batch invariance and the fused decode stack's bits."""

from __future__ import annotations

import torch
from tiny_models import tiny_model

from radixserve import LLM, SamplingParams
from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.runner import enable_decode_stack


def test_model_on_the_amx_gemm_is_batch_invariant_and_fused(tmp_path) -> None:
    """A tiny bfloat16 Llama with every projection and the LM head on the AMX GEMM (emulated
    off the AMX kind): greedy tokens and logprobs alone equal batched, and the fused decode
    stack gives the per-op path's bits."""
    path = tiny_model(tmp_path, "qwen2")  # Q/K/V bias: added after the product
    kernels = CpuKernels.load()
    assert kernels is not None
    on_amx = kernels.amx.available
    results = {}
    for fused in (True, False):
        # off the AMX kind the dense weights are kept (no oneDNN packing, which a bfloat16 CPU
        # would pick) for use_amx_linears below to take
        llm = LLM(model=path, dtype="bfloat16", num_pages=128, seed=0, max_num_seqs=8,
                  enable_prefix_caching=False, **({} if on_amx else {"pack_weights": False}))
        runner = llm.engine.runner
        model = runner.model
        if on_amx:  # the engine's own pick on this kind
            assert runner.paths.paths["linear"] == "amx", runner.paths.reasons["linear"]
        else:
            model.use_amx_linears(kernels.amx, emulate=True)
        model.decode_stack = None
        path_name, why = enable_decode_stack(model, fused)
        assert path_name == ("fused" if fused else "per-op"), why
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
        prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 3 * i))} for i in range(4)]
        together = llm.generate(prompts, sp, use_tqdm=False)
        alone = [llm.generate(p, sp, use_tqdm=False)[0] for p in prompts]
        got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in together]
        assert got == [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in alone]
        results[fused] = got
        llm.engine.shutdown()
    assert results[True] == results[False]
    assert len({tuple(t) for t, _ in results[True]}) > 1  # not a degenerate model


def test_amx_path_is_picked_only_where_the_tiles_run(tmp_path) -> None:
    """The engine's choice follows the CPU: "amx" for bfloat16 where the tile path runs, never
    elsewhere or in float32, and ``--no-cpu-linear-kernel`` (the oneDNN reference) turns it
    off."""
    path = tiny_model(tmp_path, "llama")
    for dtype, kernel in (("bfloat16", True), ("float32", True), ("bfloat16", False)):
        llm = LLM(model=path, dtype=dtype, num_pages=64, cpu_linear_kernel=kernel)
        runner = llm.engine.runner
        amx = runner.kernels is not None and runner.kernels.amx.available
        want = amx and dtype == "bfloat16" and kernel
        assert (runner.paths.paths["linear"] == "amx") == want, (
            runner.paths.reasons["linear"],
            None if runner.kernels is None else runner.kernels.amx.self_check())
        assert runner.dtype == getattr(torch, dtype)
        llm.engine.shutdown()
