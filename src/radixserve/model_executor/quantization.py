"""Which form the linear weights are served in (``--quantization``), decided before loading.

* ``gguf``: a GGUF file's quantized tensors are served in their blocks (Q4_0, Q4_1, Q5_0, Q5_1,
  Q8_0, Q4_K, Q5_K, Q6_K) by radixserve's quantized kernels; other types are dequantized. The default for a
  GGUF on CPU: a decode step reads every weight once, so 4-bit blocks read ~4x fewer bytes than
  bfloat16 (vLLM's ``--quantization gguf`` is the same choice on GPU).
* ``int8``: the projections and the LM head of a float checkpoint quantized at load to int8
  with one float32 scale per output channel, weight-only (activations stay float:
  ``layers.int8_weight_linear``); CPU only.
* ``awq`` / ``gptq``: a 4-bit AWQ or GPTQ safetensors checkpoint's linears re-packed at load
  into ggml Q4_1 / Q4_0 blocks (``loader.int4_checkpoint``) and served as a GGUF's are; the
  default for such a checkpoint on CPU.
* ``none``: every weight dense in the serving dtype (a GGUF or a 4-bit checkpoint is
  dequantized at load).
"""

from __future__ import annotations

from pathlib import Path

import torch

from radixserve.config import QUANTIZATIONS
from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.memory_fit import weight_bytes
from radixserve.model_executor.models.llama import ModelArgs

#: ``--quantization`` values (None: pick)
QUANTIZATION_CHOICES = QUANTIZATIONS


def choose_quantization(asked: str | None, gguf: Path | None, device: torch.device,
                        int4: str | None = None) -> tuple[str | None, str]:
    """The quantization to serve with (None: dense) and why.

    Args:
        asked: ``--quantization`` (None: "gguf" for a GGUF file on CPU, the checkpoint's own
            method for a 4-bit AWQ / GPTQ one, else dense).
        gguf: the GGUF file being served, or None for a safetensors folder.
        device: the serving device.
        int4: "awq" or "gptq" for a 4-bit checkpoint (``ModelArgs.int4``), else None.

    Raises:
        ValueError: a choice this model or machine cannot serve, naming why.
    """
    if asked not in (None, *QUANTIZATION_CHOICES):
        raise ValueError(f"quantization={asked!r} is not one of "
                         f"{', '.join(QUANTIZATION_CHOICES)}")
    source = ("the GGUF" if gguf is not None
              else f"the {int4.upper()} checkpoint" if int4 is not None else None)
    if asked == "none":
        return None, ("--quantization none: weights dense in the serving dtype"
                      + (f" ({source} dequantized at load)" if source else ""))
    if asked == "gguf" and gguf is None:
        raise ValueError("--quantization gguf needs a GGUF file as the model")
    if asked in ("awq", "gptq") and asked != int4:
        raise ValueError(f"--quantization {asked} needs a 4-bit {asked.upper()} checkpoint; "
                         f"this model is {source or 'unquantized'}")
    if asked == "int8" and source is not None:
        raise ValueError(f"--quantization int8 quantizes a float checkpoint; this model is "
                         f"{source} (served in its own blocks with --quantization "
                         f"{int4 or 'gguf'})")
    if asked is None and source is None:
        return None, "an unquantized checkpoint: weights dense in the serving dtype"
    why = _unavailable(device, asked == "int8")
    if why is not None:
        if asked is not None:
            raise ValueError(f"--quantization {asked}: {why}")
        return None, f"{source} is dequantized at load: {why}"
    if int4 is not None:
        return int4, (f"the {int4.upper()} checkpoint's 4-bit weights served as ggml Q4_1 / "
                      "Q4_0 blocks through radixserve's kernels")
    if asked == "int8":
        return "int8", ("--quantization int8: projections and LM head weight-only int8, a "
                        "float32 scale per output channel, through radixserve's float32 GEMM")
    return "gguf", ("the GGUF's quantized tensors served in their blocks through radixserve's "
                    "kernels" + (" (--quantization gguf)" if asked else ""))


def _unavailable(device: torch.device, int8: bool) -> str | None:
    if device.type != "cpu":
        return f"quantized kernels run on CPU, not {device.type}"
    kernels = CpuKernels.load()
    if kernels is None:
        return "radixserve's C kernels could not be built here (see the log)"
    if int8 and not kernels.quant.has_int8w:
        return "int8 weights run on radixserve's float32 GEMM, which needs AVX2 + FMA"
    return None


def served_weight_bytes(a: ModelArgs, dtype: torch.dtype, quantization: str | None,
                        gguf: Path | None) -> int:
    """Bytes the served weights take: the GGUF file's size for "gguf" (an upper bound: dense
    fall-back rows of a type without kernels take more); for "int8" one byte per projection
    and LM head value plus a float32 scale per output, the embedding dense in ``dtype`` (a
    tied LM head is an int8 copy of it); else ``weight_bytes``."""
    if quantization == "gguf" and gguf is not None:
        return gguf.stat().st_size
    if quantization in ("awq", "gptq"):
        dense = a.vocab_size * a.hidden_size * (1 if a.tie_word_embeddings else 2)
        linear_values = weight_bytes(a, torch.int8) - dense
        return (linear_values * 20 // 32
                + dense * torch.empty(0, dtype=dtype).element_size())
    if quantization == "int8":
        embed = a.vocab_size * a.hidden_size
        int8_values = weight_bytes(a, torch.int8) - embed
        if a.tie_word_embeddings:
            int8_values += embed
        outputs = a.num_layers * (a.num_heads * a.head_dim + 2 * a.num_kv_heads * a.head_dim
                                  + a.hidden_size + 2 * a.intermediate_size + a.hidden_size)
        scales = 4 * (outputs + a.vocab_size)
        return int8_values + scales + embed * torch.empty(0, dtype=dtype).element_size()
    return weight_bytes(a, dtype)


#: dequantized weights above this many bytes are not measured against the blocks: they no
#: longer sit in any CPU's cache, so a decode step reads them from memory and more bytes can
#: only be slower; and the measurement's dense copy of a layer and the LM head would cost up to
#: a GiB of transient memory at a 7B model's shapes
MEASURE_MAX_BYTES = 2 << 30


def measured_gguf_form(gguf: Path, a: ModelArgs, dtype: torch.dtype, batch_hint: int,
                       kernels: CpuKernels) -> tuple[str | None, str]:
    """For a GGUF left to ``--quantization`` auto: "gguf" or None (dequantized), whichever
    ran a layer's projections and the LM head faster on this machine (``choose_gguf_form``:
    measured once, cached), and why; "gguf" unmeasured where the dequantized weights exceed
    ``MEASURE_MAX_BYTES``."""
    from radixserve.model_executor.kernels.quant import SUPPORTED_TYPES, block_info
    from radixserve.model_executor.loader.gguf_weights import iter_gguf_weights
    from radixserve.model_executor.path_choice import choose_gguf_form

    dense = weight_bytes(a, dtype)
    if dense > MEASURE_MAX_BYTES:
        ratio = dense / gguf.stat().st_size
        return "gguf", (f"the GGUF served in its blocks: dequantized to {dtype} its weights "
                        f"would take {dense / 2**30:.1f} GiB, {ratio:.1f}x the bytes every "
                        "decode step reads (not measured above "
                        f"{MEASURE_MAX_BYTES / 2**30:.0f} GiB)")
    weights = dict(iter_gguf_weights(gguf, a.num_heads, a.num_kv_heads))
    names = [f"model.layers.0.{n}.weight" for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    names.append("lm_head.weight" if "lm_head.weight" in weights
                 else "model.embed_tokens.weight")
    picked = [weights[n] for n in names if n in weights]
    usable = [t for t in picked if t.quantized and t.ggml_type in SUPPORTED_TYPES
              and t.shape[1] % block_info(t.ggml_type)[0] == 0]
    if not usable:
        return None, "the GGUF has no tensors of a type radixserve's kernels serve: dequantized"
    key = " ".join(f"{t.ggml_type}:{t.shape[0]}x{t.shape[1]}" for t in usable)

    def blocks() -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        return [(t.ggml_type, t.block_rows(0, t.shape[0]), t.full().to(dtype))
                for t in usable]

    choice = choose_gguf_form(blocks, kernels, dtype, batch_hint,
                              f"{key} {dtype} {kernels.build_id}")
    if choice.form == "gguf":
        return "gguf", "the GGUF served in its blocks, faster here: " + choice.reason
    return None, "the GGUF dequantized at load, faster here: " + choice.reason
