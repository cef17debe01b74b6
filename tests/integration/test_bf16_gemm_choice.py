"""A bfloat16 model's linears on radixserve's float32 GEMM over the bf16 weights
(``cpu_bf16_gemm``: "float32", or "auto" where it measures faster, as on CPUs whose bf16 dot
products run at half the rate of their float32 FMAs): the rows are widened, summed in float32
and rounded back once per output. Asserted on every CPU kind (the path is asked for, never
assumed): per-op and fused decode give the same bits, a row's result does not depend on the
batch, the layer equals the float32 GEMM's output rounded to bf16, and the tokens follow the
bf16 dot-product path's but for near-ties."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from radixserve import LLM, SamplingParams
from radixserve.model_executor.device_policy import cpu_has_native_bf16
from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.layers.amx_linear import AmxLinear
from radixserve.model_executor.layers.bf16_weight_linear import Bf16WeightLinear
from radixserve.model_executor.path_choice import (
    FORM_M,
    dense_form_linear,
    last_level_cache_bytes,
    measure_bf16_gemms,
    weight_spans,
)


def test_bf16_rows_on_the_float32_gemm_are_its_float32_sums_rounded() -> None:
    kernels = CpuKernels.load()
    if kernels is None or kernels.f32_gemm_isa is None:
        pytest.skip("no float32 GEMM in this build (a CPU without AVX2 + FMA)")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(192, 320, generator=g) * 0.05).bfloat16()
    bias = torch.randn(192, generator=g).bfloat16()
    wide = Bf16WeightLinear(kernels, w, None, 128)
    narrow = Bf16WeightLinear(kernels, w, bias, 128, torch.bfloat16)
    x = torch.randn(37, 320, generator=g).bfloat16()
    got = narrow(x)
    assert got.dtype == torch.bfloat16
    want = wide(x.float()).bfloat16()
    want += bias  # after the rounding, as torch adds a bf16 bias
    assert torch.equal(got, want)
    # one row alone gets the bits it gets among 37
    assert torch.equal(narrow(x[5:6]), got[5:6])
    assert torch.allclose(got.float(), (x.float() @ w.float().T + bias.float()), atol=2e-2,
                          rtol=2e-2)
    # the packed layout (outputs interleaved per pair of vectors) gives the weight back
    assert torch.equal(narrow.weight(), w)
    ids = torch.tensor([0, 1, 15, 16, 17, 31, 32, 63, 64, 100, 191])
    assert torch.equal(narrow.rows(ids), w[ids])
    assert torch.equal(wide.rows(ids), w[ids].float())
    with pytest.raises(ValueError, match="bfloat16"):
        narrow(x.float())
    with pytest.raises(ValueError, match="bias"):
        Bf16WeightLinear(kernels, w, bias.float(), 128, torch.bfloat16)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_model_on_the_float32_gemm(tmp_path, arch: str) -> None:
    folder = tiny_model(tmp_path, arch, initializer_range=0.2, save_dtype=torch.bfloat16)
    kw = dict(model=folder, dtype="bfloat16", seed=0, num_pages=64, page_size=16,
              max_model_len=256)
    fast = LLM(**kw, cpu_bf16_gemm="float32")
    runner = fast.engine.runner
    if runner.kernels is None or runner.kernels.f32_gemm_isa is None:
        pytest.skip("no float32 GEMM in this build (a CPU without AVX2 + FMA)")
    paths = runner.paths.paths
    assert paths["bf16_gemm"] == "float32", runner.paths.reasons
    assert paths["linear"] == "bf16-weights"
    assert paths["decode_layers"] == "fused", runner.paths.reasons["decode_layers"]
    model = runner.model
    assert model.norm.dtype == torch.bfloat16
    assert model.layers[0].qkv_proj.act_dtype == torch.bfloat16
    assert model.layers[0].qkv.numel() == 0  # the dense copy freed

    per_op = LLM(**kw, cpu_bf16_gemm="float32", fused_decode=False)
    dots = LLM(**kw, cpu_bf16_gemm="bf16")
    assert dots.engine.runner.paths.paths["linear"] != "bf16-weights"
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": list(range(3 + 5 * i, 30 + 9 * i))} for i in range(5)]
    want = per_op.generate(prompts, sp, use_tqdm=False)
    for llm in (fast, per_op):
        together = llm.generate(prompts, sp, use_tqdm=False)
        alone = llm.generate(prompts[3:4], sp, use_tqdm=False)[0]
        for got, w in zip([*together, alone], [*want, want[3]], strict=True):
            assert got.outputs[0].token_ids == w.outputs[0].token_ids
            assert got.outputs[0].logprobs == w.outputs[0].logprobs
    assert len({tuple(o.outputs[0].token_ids) for o in want}) > 1
    # another arithmetic than the bf16 dot products, the same model: the first tokens agree
    for got, ref in zip(want, dots.generate(prompts, sp, use_tqdm=False), strict=True):
        a, b = got.outputs[0], ref.outputs[0]
        assert a.token_ids[0] == b.token_ids[0]
        t = a.token_ids[0]
        assert a.logprobs[0][t] == pytest.approx(b.logprobs[0][t], abs=0.1)


def test_auto_records_its_measured_choice(tmp_path) -> None:
    """``auto`` records which arithmetic a bf16 model took, and why: measured where the CPU
    has bf16 dot products, the float32 FMAs without a measurement where it has none."""
    folder = tiny_model(tmp_path, "llama", save_dtype=torch.bfloat16)
    llm = LLM(model=folder, dtype="bfloat16", seed=0, num_pages=32, page_size=16,
              max_model_len=128)
    runner = llm.engine.runner
    if runner.kernels is None or runner.kernels.f32_gemm_isa is None:
        pytest.skip("no float32 GEMM in this build (a CPU without AVX2 + FMA)")
    paths = runner.paths.paths
    if paths.get("linear") == "amx":  # the AMX kind: its own bf16 GEMM, nothing to choose
        assert "bf16_gemm" not in paths
        return
    reason = runner.paths.reasons["bf16_gemm"]
    if not cpu_has_native_bf16():  # emulated bf16 is not measured: float32, said so
        assert paths["bf16_gemm"] == "float32" and "no bf16 dot products" in reason, reason
        assert paths["linear"] == "bf16-weights"
        return
    assert paths["bf16_gemm"] in ("bf16", "float32")
    assert "float32 FMAs ms per forward M=1:" in reason
    # a tiny model's linears fit in any last-level cache: timed there, as it is served
    assert ("in cache" if last_level_cache_bytes() else "read from memory") in reason
    assert (paths["linear"] == "bf16-weights") == (paths["bf16_gemm"] == "float32")


def test_cpu_bf16_gemm_is_validated() -> None:
    with pytest.raises(ValueError, match="cpu_bf16_gemm='fp8' is not one of auto, bf16, float32"):
        LLM(cpu_bf16_gemm="fp8")


def test_cold_timings_drop_both_forms_weights_from_cache_and_keep_them() -> None:
    """A model larger than the last-level cache is timed with its weights read from memory:
    both forms' weight buffers are found and dropped from the caches before each timed call,
    and dropping them changes no value."""
    kernels = CpuKernels.load()
    if kernels is None or kernels.f32_gemm_isa is None:
        pytest.skip("no float32 GEMM in this build (a CPU without AVX2 + FMA)")
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for n, k in
          ((256, 128), (128, 128), (512, 128), (128, 256), (320, 128))]
    blocks = {tuple(w.shape): w.shape[1] for w in ws}
    fma = Bf16WeightLinear(kernels, ws[0], None, 128, torch.bfloat16)
    (address, nbytes), = weight_spans(fma)
    assert (address, nbytes) == (fma.packed.data_ptr(), fma.packed.nbytes)
    before = fma.packed.clone()
    kernels.evict_from_cache(address, nbytes)
    kernels.evict_from_cache(address + 3, 200)  # a span not on a line boundary
    assert torch.equal(fma.packed, before)
    dot = dense_form_linear(kernels, ws[0], 16, {})
    if isinstance(dot, AmxLinear) or getattr(dot, "kernel", None) is not None:
        # radixserve's AMX GEMM or its kernel over oneDNN's packing (where this CPU has one
        # that reproduces oneDNN) reads a buffer the timing can reach
        assert weight_spans(dot)
    x = torch.randn(3, 128, generator=g).bfloat16()
    want = dot(x)
    for a, b in weight_spans(dot):
        kernels.evict_from_cache(a, b)
    assert torch.equal(dot(x), want)
    secs = measure_bf16_gemms(kernels, ws, 2, 16, blocks, cold=True)
    assert {k: len(v) for k, v in secs.items()} == {"bf16": len(FORM_M), "float32": len(FORM_M)}
    assert all(t > 0 for v in secs.values() for t in v)
    llc = last_level_cache_bytes()
    assert llc is None or llc >= 1 << 16
