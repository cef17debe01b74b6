"""Batched, paged decoder for the Llama family (Llama 2/3, Mistral, SmolLM2), Qwen2/Qwen2.5
(bias on Q/K/V) and Qwen3 (RMSNorm on each head of Q and K).

Tokens of all requests in a step are flattened to one ``[T, hidden]`` stream; attention is the
only op that sees request boundaries (through ``AttentionMetadata``). Q/K/V and gate/up
projections are fused into one matmul each. Numerics follow Hugging Face ``transformers``
(RMSNorm in float32, rotate-half RoPE with cos/sin cast to the activation dtype) so greedy tokens
match it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model_executor.attention.paged_attention import AttentionMetadata
from radixserve.model_executor.attention.registry import build_attention
from radixserve.model_executor.cpu_malloc import release_free_heap
from radixserve.model_executor.kernels.amx import AmxKernels
from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.kernels.quant import (
    PACK16,
    SUPPORTED_TYPES,
    QuantKernels,
    block_info,
)
from radixserve.model_executor.layers.amx_linear import AmxLinear
from radixserve.model_executor.layers.bf16_weight_linear import Bf16WeightLinear
from radixserve.model_executor.layers.int8_weight_linear import (
    INT8_CHANNEL,
    Int8WeightLinear,
    quantize_per_channel,
)
from radixserve.model_executor.layers.linear import (
    KernelFactory,
    LinearFn,
    dense_linear,
    packed_linear,
)
from radixserve.model_executor.layers.packed_kernel import find_k_block, packed_kernel_linear
from radixserve.model_executor.layers.quantized import (
    QuantizedEmbedding,
    QuantizedLinear,
    Segment,
)
from radixserve.model_executor.loader.int4_checkpoint import Int4Scheme, folder_scheme
from radixserve.model_executor.loader.lazy_tensor import (
    LazyTensor,
    StagingBuffer,
    as_lazy,
    copy_rows,
)
from radixserve.model_executor.parallel.group import TensorParallelGroup
from radixserve.model_executor.parallel.sharding import ShardLayout, single

#: RoPE variants computed exactly (their inverse frequencies from transformers' own
#: ``ROPE_INIT_FUNCTIONS``, ``rope_inv_freq``); "dynamic" rescales with the sequence length
#: and "longrope" switches factors past its original context: neither is implemented
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

#: the most rows of a weight ``find_k_block`` packs in float32 to find oneDNN's K blocking
#: for a bf16-weight model (``CausalLM.use_bf16_weight_linears``)
PROBE_MAX_ROWS = 8192

#: how linear weights may be held besides dense: "gguf" (a GGUF's quantized blocks as stored)
#: or "int8" (int8 per output channel, made at load from a float checkpoint)
QUANTIZATIONS = ("gguf", "int8")
#: a projection held quantized: GGUF blocks or int8 per output channel
QuantMethod = QuantizedLinear | Int8WeightLinear

#: the parameters whose weights a quantization may hold in blocks instead
_LINEAR_PARAMS = ("qkv", "o", "gate_up", "down")

#: the most rows the MLP runs at once: a longer prefill chunk runs it in slices of this many
#: rows, so its gate/up output (2 x intermediate values per row) is not held for the whole
#: chunk (Qwen2.5-7B, 2,048 rows: 155 MB of bf16 gate/up, 78 MB after SiLU, 48 MB of
#: quantized activations for the down projection). radixserve's linear kernels give a row
#: the same bits whatever the row count, so on them the slices change no output (oneDNN,
#: where it serves, rounds a row by its batch in any case). CPU only: a GPU's prefill
#: activations are small beside its memory, and its GEMMs run best whole.
MLP_MAX_ROWS = 512

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class LayerStack(Protocol):
    """Runs every layer of the steps it ``applies`` to in one call (the fused decode stack,
    ``models.decode_stack``)."""

    def applies(self, h: torch.Tensor, meta: AttentionMetadata) -> bool: ...

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kv_layers: list[torch.Tensor], meta: AttentionMetadata
            ) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerOps(Protocol):
    """A layer's elementwise steps fused, one call each: the CPU kernels
    (``kernels.cpu.CpuKernels``) or the Triton kernels on CUDA (``kernels.triton_ops``). Without
    one the layer runs torch ops (the reference path)."""

    def add_rms_norm(self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


@dataclass
class ModelArgs:
    """The subset of a Hugging Face config the forward needs."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    #: attention window in tokens (Mistral v0.1's 4096), None: every earlier token
    sliding_window: int | None = None
    #: an AWQ / GPTQ 4-bit checkpoint's scheme (``loader.int4_checkpoint``), else None
    int4: Int4Scheme | None = None

    @classmethod
    def from_hf(cls, config) -> ModelArgs:  # noqa: ANN001 - transformers PretrainedConfig
        """The forward's sizes from a Hugging Face config, refusing what this model cannot
        compute as the checkpoint's authors meant it, before any weight is read.

        Raises:
            ValueError: naming the config field and its value: an architecture radixserve does
                not implement, a ``quantization_config`` other than 4-bit AWQ / GPTQ
                (``Int4Scheme.from_config``), a
                ``hidden_act`` other than SiLU, ``mlp_bias``, a ``partial_rotary_factor``
                below 1, or a RoPE type without an exact implementation here (``dynamic``,
                unknown ones).
        """
        archs = list(getattr(config, "architectures", None) or [])
        kind = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES),
                    None)
        if kind is None:
            raise ValueError(f"unsupported architecture {archs or config.model_type!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        int4 = folder_scheme(None, config)
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config.json: hidden_act={act!r} is not supported (SiLU only)")
        if getattr(config, "mlp_bias", False):
            raise ValueError("config.json: mlp_bias=true is not supported (no MLP biases)")
        partial = getattr(config, "partial_rotary_factor", 1.0)
        if partial is not None and partial != 1.0:
            raise ValueError(f"config.json: partial_rotary_factor={partial} is not supported "
                             "(RoPE over the whole head only)")
        params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling",
                                                                     None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"config.json: rope_type={rope_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            arch=kind, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim, rms_norm_eps=config.rms_norm_eps,
            qkv_bias=kind == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=kind == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(config, "max_position_embeddings", 4096),
            int4=int4,
            sliding_window=_sliding_window(config))

    def check_context(self, max_model_len: int) -> None:
        """Refuse a context the model's attention cannot serve as trained.

        Raises:
            ValueError: ``sliding_window`` is shorter than ``max_model_len``: radixserve
                attends to every earlier token, which past the window is not the model's
                attention (Mistral-7B-v0.1, window 4096).
        """
        w = self.sliding_window
        if w is not None and w < max_model_len:
            raise ValueError(f"config.json: sliding_window={w} is shorter than max_model_len="
                             f"{max_model_len}; radixserve has no sliding-window attention, so "
                             f"serve this model with --max-model-len {w} (or less)")


def _sliding_window(config) -> int | None:  # noqa: ANN001 - transformers PretrainedConfig
    """The window the model attends within: Mistral's ``sliding_window``; Qwen2/Qwen3's only
    when ``use_sliding_window`` is true (their configs carry a window they do not use)."""
    w = getattr(config, "sliding_window", None)
    if not isinstance(w, int) or w <= 0:
        return None
    if hasattr(config, "use_sliding_window") and not config.use_sliding_window:
        return None
    return w


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:  # noqa: ANN001
    """Inverse frequencies float32 [head_dim // 2] and cos/sin scaling for the checkpoint's RoPE.

    Scaled variants (llama3, yarn, linear, ...) come from transformers' ``ROPE_INIT_FUNCTIONS``
    so they match the reference exactly.
    """
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                               / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    return ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim with transformers' ``LlamaRMSNorm`` numerics: normalize in
    float32, cast back, then scale (the fused ``F.rms_norm`` is bit-identical in float32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face / GPT-NeoX layout).

    Args:
        x: [T, heads, D].
        cos, sin: [T, 1, D // 2] in x's dtype (the two halves of transformers' tables are
            equal, so half is enough).
    Returns: [T, heads, D], a new tensor.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderLayer(nn.Module):
    """One decoder layer over this rank's heads and intermediate columns.

    Args:
        a: this rank's sizes (``ShardLayout.local_args``; the full model's without TP).
        kernels: the CPU kernel library or None.
        attention_backend: the resolved attention backend (``build_attention``).
        ops: the fused norm / RoPE / activation steps; None: ``kernels`` when given, else
            torch ops.
        weight_dtype: the four projections' weights' dtype where it differs from the
            activations' ``dtype`` (bf16 weights under float32, ``layers.bf16_weight_linear``).
    """

    def __init__(self, a: ModelArgs, kernels: CpuKernels | None = None,
                 attention_backend: str | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", ops: LayerOps | None = None,
                 weight_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.a = a
        f = {"dtype": dtype, "device": device}
        wf = {"dtype": weight_dtype or dtype, "device": device}
        #: the tensor-parallel group when sharded (``CausalLM.join_group``): the row-parallel
        #: outputs (o, down) are partial sums to all-reduce
        self.tp: TensorParallelGroup | None = None
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.q_size, self.kv_size = q, kv
        self.input_norm = nn.Parameter(torch.ones(a.hidden_size, **f))
        self.post_norm = nn.Parameter(torch.ones(a.hidden_size, **f))
        self.qkv = nn.Parameter(torch.empty(q + 2 * kv, a.hidden_size, **wf))
        self.qkv_bias = nn.Parameter(torch.zeros(q + 2 * kv, **f)) if a.qkv_bias else None
        self.o = nn.Parameter(torch.empty(a.hidden_size, q, **wf))
        self.q_norm = nn.Parameter(torch.ones(a.head_dim, **f)) if a.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(a.head_dim, **f)) if a.qk_norm else None
        self.gate_up = nn.Parameter(torch.empty(2 * a.intermediate_size, a.hidden_size, **wf))
        self.down = nn.Parameter(torch.empty(a.hidden_size, a.intermediate_size, **wf))
        scale = a.head_dim ** -0.5
        backend = attention_backend or ("torch" if kernels is None else "cpu")
        self.attn = build_attention(backend, a.num_heads, a.num_kv_heads, a.head_dim, scale,
                                    kernels)
        self.kernels = kernels
        self.ops: LayerOps | None = ops if ops is not None else kernels
        #: projections held in blocks (``set_quantized``), by parameter name
        self.quantized: dict[str, QuantMethod] = {}
        self.qkv_proj: LinearFn
        self.o_proj: LinearFn
        self.gate_up_proj: LinearFn
        self.down_proj: LinearFn
        self.bind_dense_linears()

    def bind_dense_linears(self) -> None:
        """Run the four projections as ``F.linear`` over this layer's own parameters (a deep
        copy of the layer must call it: the bound callables capture the parameters); a
        projection held quantized (``quantized``) keeps its method."""
        bias = {"qkv": self.qkv_bias}
        for n in _LINEAR_PARAMS:
            if n not in self.quantized:
                setattr(self, n + "_proj", dense_linear(self.get_parameter(n), bias.get(n)))

    def set_quantized(self, name: str, method: QuantMethod) -> None:
        """Hold projection ``name`` ("qkv", "o", "gate_up", "down") as ``method``; its dense
        parameter is freed."""
        self.quantized[name] = method
        setattr(self, name + "_proj", method)
        p = self.get_parameter(name)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def pack_linears(self, batch_hint: int, kernel: KernelFactory | None = None) -> bool:
        """Pack the four projections for oneDNN (CPU) and free their dense copies;
        ``kernel`` as in ``packed_linear``.

        Returns False where packing is not available (decided on the first weight, before
        anything is freed)."""
        names = tuple(n for n in _LINEAR_PARAMS if n not in self.quantized)
        ops = [packed_linear(self.get_parameter(n), getattr(self, n + "_bias", None), batch_hint,
                             kernel)
               for n in names]
        if any(op is None for op in ops):
            return False
        for n, op in zip(names, ops, strict=True):
            setattr(self, n + "_proj", op)
            self.get_parameter(n).data = torch.empty(0, dtype=self.get_parameter(n).dtype)
        return True

    def use_amx_linears(self, amx: AmxKernels, emulate: bool = False) -> None:
        """Run the four projections on radixserve's AMX GEMM (``layers.amx_linear``) for every
        row count and free their dense weights; a bfloat16 layer's (the Q/K/V bias is added
        after the product)."""
        bias = {"qkv": self.qkv_bias}
        for n in _LINEAR_PARAMS:
            if n in self.quantized:
                continue
            w = self.get_parameter(n)
            setattr(self, n + "_proj", AmxLinear(amx, w.data, bias.get(n), emulate))
            w.data = torch.empty(0, dtype=w.dtype)

    def use_bf16_weight_linears(self, kernels: CpuKernels,
                                k_blocks: dict[tuple[int, int], int],
                                act_dtype: torch.dtype = torch.float32) -> None:
        """Run the four projections on the float32 GEMM over their bfloat16 weights
        (``layers.bf16_weight_linear``), for every row count, and free the dense weights;
        ``k_blocks`` gives each [N, K]'s K blocking, ``act_dtype`` the activations' dtype."""
        bias = {"qkv": self.qkv_bias}
        for n in _LINEAR_PARAMS:
            w = self.get_parameter(n)
            setattr(self, n + "_proj", Bf16WeightLinear(kernels, w.data, bias.get(n),
                                                        k_blocks[tuple(w.shape)], act_dtype))
            w.data = torch.empty(0, dtype=w.dtype)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: (h, residual) [T, hidden] -> (h, residual) of the next. Both are
        tensors the model's forward created, so this layer may write over them: residual is
        updated in place, and on CPU h's and the attention output's storage is reused for
        the normed rows and the MLP's output. A 2,048-token prefill chunk of Qwen2.5-7B in
        float32 otherwise held eight [T, hidden] tensors (29 MB each) at the MLP."""
        a = self.a
        k = self.ops
        # on CPU: storage this layer may overwrite once its values are consumed (the CUDA
        # paths keep fresh tensors: their memory is small beside the device's, and graphs)
        reuse = k is not None and h.device.type == "cpu"
        spare = None
        if k is not None:
            # residual updated in place: it is always a tensor this forward created
            if residual is not None and reuse and h.is_contiguous():
                x = spare = k.add_rms_norm(h, residual, self.input_norm, a.rms_norm_eps, out=h)
            else:
                x = k.add_rms_norm(None if residual is None else h,
                                   h if residual is None else residual,
                                   self.input_norm, a.rms_norm_eps)
            residual = h if residual is None else residual
        else:
            residual = h if residual is None else residual + h
            x = rms_norm(residual, self.input_norm, a.rms_norm_eps)
        qkv = self.qkv_proj(x)
        t = x.shape[0]
        nq = a.num_heads
        # Q and K side by side in the fused output: one RoPE call for both
        qk = qkv[:, :self.q_size + self.kv_size].view(t, nq + a.num_kv_heads, a.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, a.num_kv_heads, a.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((rms_norm(qk[:, :nq], self.q_norm, a.rms_norm_eps),
                            rms_norm(qk[:, nq:], self.k_norm, a.rms_norm_eps)), dim=1)
        if k is not None:
            # in place: Q and K stay views of the fused projection's output (its own tensor)
            k.rope_(qk, cos, sin)
        else:
            qk = apply_rope(qk, cos.unsqueeze(1), sin.unsqueeze(1))
        o = self.attn.forward(qk[:, :nq], qk[:, nq:], v, kv, meta)
        del qk, v, qkv
        h = self.o_proj(o)
        del o
        if self.tp is not None:
            self.tp.all_reduce(h)
        if k is not None:
            x = k.add_rms_norm(h, residual, self.post_norm, a.rms_norm_eps,
                               out=h if reuse and h.is_contiguous() else None)
        else:
            residual = residual + h
            x = rms_norm(residual, self.post_norm, a.rms_norm_eps)
        del h
        if x.shape[0] <= MLP_MAX_ROWS or x.device.type != "cpu":
            out = self._mlp(x)
        else:
            out = spare if spare is not None else x.new_empty(x.shape)
            for i in range(0, x.shape[0], MLP_MAX_ROWS):
                out[i:i + MLP_MAX_ROWS] = self._mlp(x[i:i + MLP_MAX_ROWS])
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out, residual

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)): [T, hidden] -> [T, hidden] (this rank's partial sum
        under tensor parallelism)."""
        gu = self.gate_up_proj(x)
        if self.ops is not None:
            return self.down_proj(self.ops.silu_mul(gu))
        gate, up = gu.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class CausalLM(nn.Module):
    """The whole decoder plus LM head.

    Args:
        a: architecture sizes.
        inv_freq: float32 [head_dim // 2] RoPE inverse frequencies; ``rope_scale`` multiplies
            cos/sin (transformers' ``attention_scaling``).
        max_positions: rows of the precomputed cos/sin table.
        kernels: the CPU kernel library (paged decode attention, fused add + RMSNorm), or None
            for torch ops only.
        attention_backend: the resolved attention backend (``build_attention``); None: "cpu"
            with ``kernels``, else "torch".
        shard: this rank's share under tensor parallelism (``parallel.sharding``); None holds
            the whole model. ``load_weights`` then takes full checkpoint tensors and keeps
            this rank's slices; ``join_group`` must follow before the first forward.
        dtype, device: where the parameters live, from the start (the serving dtype: a
            checkpoint is never held in another dtype on the way, see ``load_weights``).
        weight_dtype: the embedding's, LM head's and projections' dtype where it differs
            from ``dtype``: bfloat16 under float32 activations, the weights held as a bf16
            checkpoint ships them (``use_bf16_weight_linears``); None: ``dtype``.
        quantization: None (every weight dense in ``dtype``), "gguf" (a GGUF's quantized
            projections, embedding and LM head kept in their blocks) or "int8" (the
            projections and the LM head, tied or not, quantized to int8 per output channel at
            load, the embedding dense: ``layers.int8_weight_linear``); see
            ``layers.quantized``. Needs ``quant`` and a CPU model; under tensor parallelism
            each rank holds its rows (and row-parallel columns) in blocks.
        quant: the quantized kernels (``CpuKernels.quant``), with ``quantization``.
        layer_ops: the fused norm / RoPE / activation steps of every layer and the final norm
            (the Triton kernels on CUDA); None: ``kernels`` when given, else torch ops.

    Raises:
        ValueError: a quantization without its kernels, or on another device.
    """

    def __init__(self, a: ModelArgs, inv_freq: torch.Tensor, rope_scale: float,
                 max_positions: int, kernels: CpuKernels | None = None,
                 attention_backend: str | None = None,
                 shard: ShardLayout | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", quantization: str | None = None,
                 quant: QuantKernels | None = None, layer_ops: LayerOps | None = None,
                 weight_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.a = a
        self.shard = shard or single(a)
        if quantization is not None:
            if quantization not in QUANTIZATIONS:
                raise ValueError(f"quantization={quantization!r} is not one of "
                                 f"{', '.join(QUANTIZATIONS)}")
            if quant is None or torch.device(device).type != "cpu":
                raise ValueError(f"quantization={quantization!r} runs on CPU with radixserve's "
                                 "C kernels")
        self.quantization, self.quant = quantization, quant
        #: the embedding looked up from blocks (``quantization`` "gguf"), else None
        self.embed_q: QuantizedEmbedding | None = None
        #: the LM head held quantized, else None (dense or packed, ``_lm_head_proj``)
        self.lm_head_q: QuantMethod | None = None
        local = self.shard.local_args(a)
        rows = self.shard.vocab_rows
        f = {"dtype": dtype, "device": device}
        wf = {"dtype": weight_dtype or dtype, "device": device}
        self.tp: TensorParallelGroup | None = None
        self.embed = nn.Parameter(torch.empty(rows, a.hidden_size, **wf))
        #: the tied embedding looked up in the LM head's packed bf16 weights
        #: (``use_bf16_weight_linears``), else None
        self.embed_rows: Bf16WeightLinear | None = None
        self._f32_k_blocks: dict[tuple[int, int], int] | None = None
        self.layers = nn.ModuleList(DecoderLayer(local, kernels, attention_backend, dtype,
                                                 device, layer_ops, weight_dtype)
                                    for _ in range(a.num_layers))
        self.kernels = kernels
        self.ops: LayerOps | None = layer_ops if layer_ops is not None else kernels
        self.norm = nn.Parameter(torch.ones(a.hidden_size, **f))
        self.lm_head = None if a.tie_word_embeddings else nn.Parameter(
            torch.empty(rows, a.hidden_size, **wf))
        self._lm_head_proj: LinearFn | None = None
        #: float32 logits on CPU, kept between steps (``compute_logits``)
        self._logits_buf: torch.Tensor | None = None
        #: decode steps' layers in one C call (``models.decode_stack``, set by the runner),
        #: or None: per op
        self.decode_stack: LayerStack | None = None
        #: [N, K] -> the packed linear kernel's K blocking, None where oneDNN stays
        #: (``pack_linears(linear_kernel=True)``)
        self.kernel_k_blocks: dict[tuple[int, int], int | None] = {}
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        # float32 tables [max_positions, head_dim // 2], kept outside the module's buffers so
        # ``.to(dtype)`` never rounds them
        self.cos_table = freqs.cos() * rope_scale
        self.sin_table = freqs.sin() * rope_scale

    def pack_linears(self, batch_hint: int, linear_kernel: bool = False,
                     kernel_max_rows: int | None = None) -> bool:
        """Pack every projection and the LM head for oneDNN (CPU float32/bfloat16); the dense
        layer weights are freed (the embedding stays: token lookup needs it). Call after the
        weights are loaded and cast. Returns False where packing is not
        available.

        Args:
            batch_hint: tokens per call the packed layout is tuned for (any count works).
            linear_kernel: calls of up to ``kernel_max_rows`` rows through
                radixserve's C kernel over the packed weights where it reproduces oneDNN's GEMM
                (``packed_kernel``); ``kernel_k_blocks`` then says, per [N, K], its K blocking
                or None (oneDNN).
            kernel_max_rows: the kernel's row cap measured on this machine
                (``path_choice.choose_kernel_rows``); None: ``max_rows_for``'s rule.
        """
        factory = None
        if linear_kernel and self.kernels is not None:
            kernels, blocks = self.kernels, self.kernel_k_blocks

            def factory(packed: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> LinearFn | None:
                return packed_kernel_linear(kernels, packed, weight, bias, batch_hint, blocks,
                                            kernel_max_rows)

        w = self.embed if self.lm_head is None else self.lm_head
        head = (self.lm_head_q if self.lm_head_q is not None
                else packed_linear(w, None, batch_hint, factory))
        if head is None:
            return False
        for layer in self.layers:
            if not layer.pack_linears(batch_hint, factory):
                return False
            # glibc keeps the freed dense weights as scattered heap chunks that the packed
            # copies do not fit: hand them back a layer at a time (~45 MiB off the peak of
            # loading a 300 MiB model)
            release_free_heap(collect=False)
        self._lm_head_proj = head
        if self.lm_head is not None:
            self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)
        return True

    def use_amx_linears(self, amx: AmxKernels, emulate: bool = False) -> None:
        """Every projection and the LM head on radixserve's AMX bfloat16 GEMM, for every row
        count (``layers.amx_linear``): one reduction order per output, so a row's logits do
        not depend on the batch. The dense layer weights are freed; a tied embedding stays for
        the lookup. Call after the weights are loaded, on a bfloat16 model.

        Raises:
            ValueError: a model of another dtype.
        """
        if self.norm.dtype != torch.bfloat16:
            raise ValueError(f"the AMX GEMM is bfloat16, the model is {self.norm.dtype}")
        for layer in self.layers:
            layer.use_amx_linears(amx, emulate)
        if self.lm_head_q is None:
            w = self.embed if self.lm_head is None else self.lm_head
            self._lm_head_proj = AmxLinear(amx, w.data, None, emulate)
            if self.lm_head is not None:
                self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)

    def f32_k_blocks(self, kernels: CpuKernels, batch_hint: int) -> dict[tuple[int, int], int]:
        """The float32 GEMM's K blocking for each [N, K] of the projections and the LM head:
        oneDNN's float32 one where ``find_k_block`` finds it, else K; ``kernel_k_blocks``
        records what the probe found (None: not reproduced). Memoized: later calls return
        the first answer. The LM head is probed at ``PROBE_MAX_ROWS`` rows: a full-size
        float32 probe of a 152k-row head would cost up to 2 GiB of transient memory."""
        if self._f32_k_blocks is None:
            w_head = self.embed if self.lm_head is None else self.lm_head
            shapes = {tuple(layer.get_parameter(n).shape) for layer in self.layers
                      for n in _LINEAR_PARAMS} | {tuple(w_head.shape)}
            blocks: dict[tuple[int, int], int] = {}
            for n, k in shapes:
                kb = find_k_block(kernels, min(n, PROBE_MAX_ROWS), k, batch_hint, torch.float32)
                self.kernel_k_blocks[(n, k)] = kb
                blocks[(n, k)] = k if kb is None else kb
            self._f32_k_blocks = blocks
        return self._f32_k_blocks

    def use_bf16_weight_linears(self, kernels: CpuKernels, batch_hint: int) -> None:
        """Every projection and the LM head on the float32 GEMM over their bfloat16 weights
        (``layers.bf16_weight_linear``), for every row count; the dense weights are freed, a
        tied embedding too (its rows are then looked up in the LM head's packed weights).
        Call after the weights are loaded, on a model made with ``weight_dtype`` bfloat16
        (float32 activations), or on a bfloat16 model (bf16 activations widened per call and
        the sums rounded back: ``path_choice.choose_bf16_gemm``).

        Each [N, K]'s K blocking is ``f32_k_blocks``' (each row then gets the float32 oneDNN
        path's bits where oneDNN's blocking was found).

        Raises:
            ValueError: a model whose weights are not bfloat16 under float32 activations, or
                an output size that is not a multiple of 64.
        """
        w_head = self.embed if self.lm_head is None else self.lm_head
        act = self.norm.dtype
        if act not in (torch.float32, torch.bfloat16) or w_head.dtype != torch.bfloat16:
            raise ValueError(f"bf16-weight linears need bfloat16 weights under float32 or "
                             f"bfloat16, got {w_head.dtype} under {act}")
        blocks = self.f32_k_blocks(kernels, batch_hint)
        for layer in self.layers:
            layer.use_bf16_weight_linears(kernels, blocks, act)
        if self.lm_head_q is None:
            head = Bf16WeightLinear(kernels, w_head.data, None, blocks[tuple(w_head.shape)],
                                    act)
            self._lm_head_proj = head
            w_head.data = torch.empty(0, dtype=w_head.dtype)
            if self.lm_head is None:
                self.embed_rows = head

    def join_group(self, group: TensorParallelGroup) -> None:
        """Sharded model: run its collectives over ``group`` (size must match the shard's).

        Raises:
            ValueError: the group's size or rank differs from the shard's.
        """
        if (group.size, group.rank) != (self.shard.size, self.shard.rank):
            raise ValueError(f"group rank {group.rank}/{group.size} for shard "
                             f"{self.shard.rank}/{self.shard.size}")
        self.tp = group
        self.decode_stack = None  # its layers would skip the all-reduces
        for layer in self.layers:
            layer.tp = group

    def move_rope_tables(self, device: torch.device) -> None:
        self.cos_table = self.cos_table.to(device)
        self.sin_table = self.sin_table.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_layers: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: int64 [T]. Returns final hidden states [T, hidden]."""
        h = self._embed(input_ids)
        # [T, head_dim // 2] in the activation dtype, as transformers casts them
        cos = self.cos_table[positions].to(h.dtype)
        sin = self.sin_table[positions].to(h.dtype)
        stack = self.decode_stack
        if stack is not None and stack.applies(h, meta):
            h, residual = stack.run(h, cos, sin, kv_layers, meta)
        else:
            residual = None
            for layer, kv in zip(self.layers, kv_layers, strict=True):
                h, residual = layer(h, residual, cos, sin, kv, meta)
        if self.ops is not None:
            return self.ops.add_rms_norm(h, residual, self.norm, self.a.rms_norm_eps)
        return rms_norm(residual + h, self.norm, self.a.rms_norm_eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 [T] -> [T, hidden]; vocab-parallel: each rank looks up the ids in its rows,
        zero elsewhere, and the all-reduce adds the one non-zero row."""
        if self.tp is None:
            return self._embed_rows(input_ids)
        lo, hi = self.shard.vocab
        mine = (input_ids >= lo) & (input_ids < hi)
        h = self._embed_rows((input_ids - lo) * mine)
        h.mul_(mine.unsqueeze(1).to(h.dtype))
        return self.tp.all_reduce(h)

    def _embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of this rank's embedding in the activation dtype."""
        if self.embed_q is not None:
            return self.embed_q(ids)
        if self.embed_rows is not None:
            return self.embed_rows.rows(ids)
        h = F.embedding(ids, self.embed)
        return h if h.dtype == self.norm.dtype else h.to(self.norm.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> float32 logits [S, vocab] (vocab-parallel: every rank gets
        all of them, gathered). On CPU the float32 logits of a bf16 model are written into a
        buffer this model keeps, so they stay valid until its next ``compute_logits`` call
        (each caller consumes them within the step)."""
        if self._lm_head_proj is None and self.lm_head_q is not None:
            self._lm_head_proj = self.lm_head_q
        if self._lm_head_proj is None:
            # bound lazily: the dense weight may move device or dtype after construction
            self._lm_head_proj = dense_linear(self.embed if self.lm_head is None
                                              else self.lm_head)
        logits = self._lm_head_proj(hidden)
        if self.tp is not None:
            logits = self.tp.all_gather(logits)[:, :self.a.vocab_size]
        if logits.dtype == torch.float32 or logits.device.type != "cpu":
            return logits.float()
        return self._widen_logits(logits)

    def _widen_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.float()`` (bf16/fp16 [S, V] on CPU) into ``_logits_buf``, grown to the
        largest S seen. A fresh float32 tensor each step is fresh pages once it passes
        glibc's largest mmap threshold (32 MiB: 64 rows of a 152k vocabulary are 39 MB), each
        faulted in and zeroed by the kernel: ~10% of a generation's samples in the kernel
        (perf) at Qwen2.5-0.5B's shapes, 64 x 16 -> 128 tokens, and 18% more output tok/s
        with the buffer (Zen 5, docs/benchmarks.md)."""
        n = logits.numel()
        buf = self._logits_buf
        if buf is None or buf.numel() < n:
            buf = self._logits_buf = torch.empty(n, dtype=torch.float32)
        return buf[:n].view(logits.shape).copy_(logits)

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, LazyTensor | torch.Tensor]]) -> None:
        """Copy Hugging Face-named checkpoint tensors into the parameters, fusing Q/K/V and
        gate/up; a shard keeps its slices of the full tensors (``_shard_plan``).

        Each tensor is read a block of rows at a time (``LazyTensor``, ``loader.lazy_tensor``)
        and converted to the parameters' dtype and device block by block, so loading holds the
        model once, in its serving dtype, plus one block.

        Args:
            weights: ``(name, tensor)`` pairs; a tensor is a ``LazyTensor`` or a torch tensor
                (``[out_features, in_features]`` for a linear, any float dtype).

        Raises:
            ValueError: on a missing or unexpected tensor or a shape mismatch (naming the
                tensor and, for a GGUF, its type), or an unreadable one.
        """
        a = self.shard.local_args(self.a)
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        it = a.intermediate_size
        fused = {"q_proj": ("qkv", 0, q), "k_proj": ("qkv", q, q + kv),
                 "v_proj": ("qkv", q + kv, q + 2 * kv), "gate_proj": ("gate_up", 0, it),
                 "up_proj": ("gate_up", it, 2 * it)}
        plain = {"self_attn.o_proj.weight": "o", "mlp.down_proj.weight": "down",
                 "input_layernorm.weight": "input_norm",
                 "post_attention_layernorm.weight": "post_norm",
                 "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
        expected = {n for n, _ in self.named_parameters()}
        seen: dict[str, int] = {}
        #: parameter -> its rows held in blocks (``quantization``), bound after the loop
        blocks: dict[str, list[Segment]] = {}
        stage = StagingBuffer()  # the block rows of each tensor packed as it is read
        with torch.no_grad():
            for name, w in weights:
                src = as_lazy(name, w)
                if name == "model.embed_tokens.weight":
                    target, rng = "embed", None
                elif name == "model.norm.weight":
                    target, rng = "norm", None
                elif name == "lm_head.weight":
                    if self.lm_head is None:
                        continue  # tied: the embedding serves as LM head
                    target, rng = "lm_head", None
                elif name.startswith("model.layers."):
                    idx, rest = name[len("model.layers."):].split(".", 1)
                    proj = rest.split(".")[1] if rest.count(".") == 2 else ""
                    suffix = rest.rsplit(".", 1)[-1]
                    if proj in fused:
                        base, lo, hi = fused[proj]
                        target = f"layers.{idx}.{base}" + ("_bias" if suffix == "bias" else "")
                        rng = (lo, hi)
                    elif rest in plain:
                        target, rng = f"layers.{idx}.{plain[rest]}", None
                    elif rest.endswith("rotary_emb.inv_freq"):
                        continue
                    else:
                        raise ValueError(f"unexpected weight {src.describe()!r}")
                else:
                    raise ValueError(f"unexpected weight {src.describe()!r}")
                if target not in expected:
                    raise ValueError(f"unexpected weight {src.describe()!r} for this "
                                     "architecture")
                param = self.get_parameter(target)
                dst = param if rng is None else param[rng[0]:rng[1]]
                rows, cols, pad = self._shard_plan(name, src.shape)
                shape = (rows[1] - rows[0] + pad, *(
                    () if len(src.shape) == 1
                    else (src.shape[1] if cols is None else cols[1] - cols[0],)))
                if tuple(dst.shape) != shape:
                    raise ValueError(f"weight {src.describe()!r} has shape "
                                     f"{tuple(src.shape)}" + (f" (this shard: {shape})"
                                                              if shape != src.shape else "")
                                     + f", expected {tuple(dst.shape)}")
                seg = self._block_segment(target, src, 0 if rng is None else rng[0], rows,
                                          cols, pad, stage)
                if seg is not None:
                    blocks.setdefault(target, []).append(seg)
                else:
                    copy_rows(dst, src, rows, cols)
                    if pad:
                        dst[rows[1] - rows[0]:].zero_()
                seen[target] = seen.get(target, 0) + (dst.shape[0] if rng else param.shape[0])
        for name, p in self.named_parameters():
            if seen.get(name, 0) != p.shape[0]:
                raise ValueError(f"checkpoint is missing weights for {name!r}")
        if self.quantization is not None:
            self._bind_blocks(blocks)

    def _block_segment(self, target: str, src: LazyTensor, lo: int, rows: tuple[int, int],
                       cols: tuple[int, int] | None, pad: int,
                       stage: StagingBuffer | None = None) -> Segment | None:
        """This rank's part of ``src`` (its ``rows`` and ``cols``, then ``pad`` zero rows:
        ``_shard_plan``; going to rows ``lo:`` of parameter ``target``) in blocks, or None
        where it is copied dense: no quantization, not a linear weight, a type the kernels lack
        (a GGUF's Q3_K rows are dequantized into the serving dtype), or a tensor-parallel
        column range that cuts through the type's blocks (Q4_K's 256 values). Rows that are
        packed at once are read into ``stage``."""
        base = target.rsplit(".", 1)[-1]
        if (self.quantization is None or len(src.shape) != 2
                or base not in (*_LINEAR_PARAMS, "embed", "lm_head")):
            return None
        n = rows[1] - rows[0]
        if self.quantization == "gguf":
            t = getattr(src, "ggml_type", None)
            if (not getattr(src, "quantized", False) or t not in SUPPORTED_TYPES
                    or src.shape[1] % block_info(t)[0]):
                return None
            block, nbytes = block_info(t)
            packs = base != "embed" and self.quant is not None and self.quant.has_pack16(t)
            data = src.block_rows(rows[0], rows[1], stage if packs else None)
            if cols is not None:
                if cols[0] % block or cols[1] % block:
                    return None
                data = data[:, cols[0] // block * nbytes:cols[1] // block * nbytes].contiguous()
            if pad:  # zero bytes are zero scales: rows of zeros in every block type
                data = torch.cat([data, data.new_zeros(pad, data.shape[1])])
            if packs:
                # packed here, one tensor at a time, so the file's rows are freed as each is
                # packed (``QuantizedLinear`` would pack them all while holding them all); the
                # embedding keeps its rows (a tied one is packed with its head, ``_bind_blocks``)
                return Segment(lo, lo + n + pad, t, self.quant.pack16(t, data), layout=PACK16)
            return Segment(lo, lo + n + pad, t, data)
        if base == "embed":
            return None  # int8: the embedding stays dense for the lookup
        step = src.row_chunk()
        parts = []
        for i in range(rows[0], rows[1], step):
            # a row's scale is its whole row's: a rank's columns of a row-parallel projection
            # keep it, so the ranks' partial sums add up to one rank's product
            q, scale = quantize_per_channel(src.rows(i, min(rows[1], i + step)))
            parts.append((q if cols is None else q[:, cols[0]:cols[1]].contiguous(), scale))
        if pad:
            width = parts[0][0].shape[1]
            parts.append((torch.zeros(pad, width, dtype=torch.int8), torch.zeros(pad)))
        q = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
        scale = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
        return Segment(lo, lo + n + pad, INT8_CHANNEL, q, scale)

    def _bind_blocks(self, blocks: dict[str, list[Segment]]) -> None:
        """Turn the parameters with rows in blocks into quantized methods; rows loaded dense
        become dense segments of the same method, and the dense parameters are freed."""
        quant = self.quant
        assert quant is not None
        if self.quantization == "int8":
            self._bind_int8(blocks)
            return
        for target, segs in blocks.items():
            param = self.get_parameter(target)
            n, k = param.shape
            segs = sorted(segs, key=lambda sg: sg.lo)
            full, at = [], 0
            for sg in segs:
                if sg.lo > at:
                    full.append(Segment(at, sg.lo, None, param[at:sg.lo].clone()))
                full.append(sg)
                at = sg.hi
            if at < n:
                full.append(Segment(at, n, None, param[at:n].clone()))
            owner, _, name = target.rpartition(".")
            if name == "embed":
                if len(segs) != 1 or (segs[0].lo, segs[0].hi) != (0, n):
                    continue  # partly dense: the dense table serves
                table = segs[0]
                if self.lm_head is None:
                    # tied: the head packs the table where the build runs it packed, and the
                    # lookup gathers rows from those blocks, so they are held once
                    self.lm_head_q = QuantizedLinear(quant, n, k, full)
                    table = self.lm_head_q.segments[0]
                self.embed_q = QuantizedEmbedding(quant, table, k, param.dtype)
                param.data = torch.empty(0, dtype=param.dtype)
                continue
            method = QuantizedLinear(quant, n, k, full,
                                     getattr(self.get_submodule(owner), "qkv_bias", None)
                                     if name == "qkv" else None)
            if name == "lm_head":
                self.lm_head_q = method
                param.data = torch.empty(0, dtype=param.dtype)
            else:
                self.get_submodule(owner).set_quantized(name, method)

    def _bind_int8(self, blocks: dict[str, list[Segment]]) -> None:
        """``quantization`` "int8": each parameter quantized at load becomes an
        ``Int8WeightLinear``; a tied LM head is quantized here from the dense embedding,
        which stays for the lookup."""
        quant = self.quant
        assert quant is not None
        while blocks:
            # popped: each parameter's int8 rows are freed once packed, so the model is never
            # held twice
            target, segs = blocks.popitem()
            segs = sorted(segs, key=lambda sg: sg.lo)
            q = torch.cat([sg.data for sg in segs])
            scale = torch.cat([sg.scale for sg in segs if sg.scale is not None])
            owner, _, name = target.rpartition(".")
            param = self.get_parameter(target)
            if q.shape[0] != param.shape[0] or scale.shape[0] != param.shape[0]:
                raise ValueError(f"{target}: {q.shape[0]} of {param.shape[0]} rows quantized")
            bias = (getattr(self.get_submodule(owner), "qkv_bias", None) if name == "qkv"
                    else None)
            method = Int8WeightLinear(quant, q, scale, bias)
            if name == "lm_head":
                self.lm_head_q = method
                param.data = torch.empty(0, dtype=param.dtype)
            else:
                self.get_submodule(owner).set_quantized(name, method)
        if self.lm_head is None:
            step = max(1, (64 << 20) // (4 * self.embed.shape[1]))
            parts = [quantize_per_channel(self.embed[i:i + step].detach())
                     for i in range(0, self.embed.shape[0], step)]
            self.lm_head_q = Int8WeightLinear(quant, torch.cat([p[0] for p in parts]),
                                              torch.cat([p[1] for p in parts]))

    def _shard_plan(self, name: str, shape: tuple[int, ...]
                    ) -> tuple[tuple[int, int], tuple[int, int] | None, int]:
        """Which part of the full checkpoint tensor ``name`` this rank keeps (Megatron layout,
        see ``parallel.sharding``): ``(row range, column range or None, zero rows to add)``.
        Rows of the column-parallel projections and of the vocab-parallel embedding / LM head
        (zero rows past the vocabulary), columns of the row-parallel ``o_proj``/``down_proj``;
        norms whole. Without tensor parallelism: every row, every column."""
        whole = ((0, shape[0]), None, 0)
        sh, d = self.shard, self.a.head_dim
        if sh.size == 1:
            return whole
        ranges = {"q_proj": (sh.q_heads[0] * d, sh.q_heads[1] * d),
                  "k_proj": (sh.kv_heads[0] * d, sh.kv_heads[1] * d),
                  "v_proj": (sh.kv_heads[0] * d, sh.kv_heads[1] * d),
                  "gate_proj": sh.intermediate, "up_proj": sh.intermediate,
                  "o_proj": (sh.q_heads[0] * d, sh.q_heads[1] * d),
                  "down_proj": sh.intermediate}
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            lo, hi = sh.vocab
            end = max(lo, min(hi, shape[0]))
            return (lo, end), None, sh.vocab_rows - (end - lo)
        proj = name.rsplit(".", 2)[-2]
        if proj not in ranges:
            return whole
        lo, hi = ranges[proj]
        if proj in ("o_proj", "down_proj"):
            return (0, shape[0]), (lo, hi), 0
        return (lo, hi), None, 0

