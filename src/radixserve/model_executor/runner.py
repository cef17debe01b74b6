"""``ModelRunner``: loads a model and its KV storage, runs one ``ForwardBatch``: arrays in,
sampled tokens out. ``build_runner`` picks it or the null model for a configuration."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import numpy as np
import torch

from radixserve.config import EngineConfig
from radixserve.engine_types import RunnerStats
from radixserve.kvcache.sizing import plan_kv_pool
from radixserve.kvcache.storage import KVStorage
from radixserve.model_executor.attention.paged_attention import AttentionMetadata
from radixserve.model_executor.cpu_malloc import release_free_heap, tune_malloc
from radixserve.model_executor.cuda_graphs import maybe_decode_graphs
from radixserve.model_executor.device_policy import (
    ForwardPaths,
    attention_isa,
    attention_reason,
    cpu_has_native_bf16,
    resolve_device,
    resolve_dtype,
    select_cpu_kernels,
    select_layer_ops,
    select_triton,
)
from radixserve.model_executor.forward_batch import ForwardBatch, SampleResult
from radixserve.model_executor.kernels.cpu import CpuKernels
from radixserve.model_executor.loader.int4_checkpoint import int4_weights
from radixserve.model_executor.memory_fit import fit_dtype, weight_bytes
from radixserve.model_executor.models.decode_stack import DecodeStack
from radixserve.model_executor.models.llama import CausalLM, ModelArgs, rope_inv_freq
from radixserve.model_executor.parallel.group import TensorParallelGroup
from radixserve.model_executor.parallel.sharding import ShardLayout
from radixserve.model_executor.path_choice import (
    KernelRowsChoice,
    choose_bf16_gemm,
    choose_kernel_rows,
    choose_linear_path,
)
from radixserve.model_executor.quantization import (
    choose_quantization,
    measured_gguf_form,
    served_weight_bytes,
)
from radixserve.model_executor.sampler import prompt_logprob_rows, sample
from radixserve.model_executor.shadow import ShadowChecker, reference_copy
from radixserve.model_executor.step_runner import ModelInfo
from radixserve.model_executor.weight_storage import bf16_weights_reason

log = logging.getLogger(__name__)


def _quant_kernels(kernels: CpuKernels | None):  # noqa: ANN202 - QuantKernels
    """The quantized kernels of the C library (loaded here when attention does not use it)."""
    lib = kernels or CpuKernels.load()
    if lib is None:
        raise ValueError("quantized weights need radixserve's C kernels, which could not be "
                         "built here (see the log)")
    return lib.quant


def enable_decode_stack(model: CausalLM, on: bool) -> tuple[str, str]:
    """Run decode steps' layers in one C call where the model allows it (after
    ``pack_linears``; ``decode_stack.py``). Returns the path ("fused" or "per-op") and why."""
    if not on:
        model.decode_stack = None
        return "per-op", "--no-fused-decode"
    # the shard, not ``model.tp``: the group is joined after loading
    why = DecodeStack.eligible(list(model.layers), model.kernels, model.shard.size > 1)
    if why is not None:
        model.decode_stack = None
        return "per-op", why
    model.decode_stack = DecodeStack(model.kernels, list(model.layers))
    return "fused", ("decode steps run every layer in one call of radixserve's C kernels "
                     "(the per-op path's kernels, in its order)")


class ModelRunner:
    """Loads a Hugging Face-format model, owns its KV cache, runs steps.

    Args:
        config: engine configuration (model, dtype, device, KV sizing, max_model_len).
        tp_rank: under tensor parallelism (``config.tensor_parallel_size`` > 1) the rank whose
            shard this runner holds: its heads, intermediate columns, vocabulary rows and KV
            heads (``parallel.sharding``); ``join_group`` must follow before the first step.
            KV sizing (``kv_cache_memory``) is per rank.

    Raises:
        ValueError: unreadable model, unsupported architecture, bad dtype/device, a
            tensor-parallel size the model's heads do not split by.
        RuntimeError: ``kv_transfer_config`` names a connector whose transport is missing.
    """

    def __init__(self, config: EngineConfig, tp_rank: int = 0) -> None:
        from radixserve.model_executor.loader import (
            checkpoint_weights,
            eos_token_ids,
            read_config,
            resolve_model,
        )

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        files = resolve_model(config.model)
        hf_config = read_config(files.folder)
        args = ModelArgs.from_hf(hf_config)
        self.shard = ShardLayout.for_model(args, tp_rank, config.tensor_parallel_size)
        self.device = resolve_device(config.device)
        if self.device.type == "cuda" and self.shard.size > 1:
            self.device = torch.device("cuda", tp_rank)
            torch.cuda.set_device(self.device)
        quantization, quant_why = choose_quantization(
            config.quantization, files.gguf, self.device,
            None if args.int4 is None else args.int4.method)
        if quantization == "gguf" and config.quantization is None:
            quantization, quant_why = self._auto_gguf_form(config, files.gguf, args)
        bf16_no = bf16_weights_reason(
            linear_kernel=config.cpu_linear_kernel, pack_weights=config.pack_weights,
            attention_backend=config.attention_backend, device=self.device,
            quantization=quantization, gguf=files.gguf, folder=files.folder,
            local=self.shard.local_args(args), vocab_rows=self.shard.vocab_rows)

        def served_bytes(dt: torch.dtype) -> int:
            if dt == torch.float32 and bf16_no is None:
                return weight_bytes(args, torch.bfloat16)
            return served_weight_bytes(args, dt, quantization, files.gguf)

        self.dtype, dtype_change = fit_dtype(
            config.dtype, resolve_dtype(config.dtype, self.device), args, self.device,
            self.shard.size, bytes_for=served_bytes)
        #: the embedding's, LM head's and projections' dtype where not ``dtype``: bf16
        #: checkpoint weights held as shipped under float32 activations (``weight_storage``)
        self.weight_dtype = (torch.bfloat16 if bf16_no is None and self.dtype == torch.float32
                             else None)
        self.args = args
        page_size = config.page_size
        kv_heads = self.shard.num_kv_heads
        per_page = KVStorage.bytes_per_page(args.num_layers, page_size, kv_heads,
                                            args.head_dim, self.dtype)
        plan = plan_kv_pool(page_size=page_size, num_pages=config.num_pages,
                            kv_cache_memory=config.kv_cache_memory, bytes_per_page=per_page,
                            max_num_seqs=config.max_num_seqs,
                            model_max_len=args.max_position_embeddings,
                            max_model_len=config.max_model_len)
        num_pages = plan.num_pages
        self.num_pages = num_pages
        self.max_model_len = plan.max_model_len
        args.check_context(self.max_model_len)
        model_len = config.max_model_len or args.max_position_embeddings
        inv_freq, rope_scale = rope_inv_freq(hf_config, args.head_dim)
        self.kernels = select_cpu_kernels(config.attention_backend, self.device, self.dtype)
        use_triton, no_triton = select_triton(config.attention_backend, self.device,
                                              self.dtype)
        #: "cpu" (radixserve's C kernels), "triton" (its Triton kernels) or "torch" (SDPA)
        self.attention_backend = ("cpu" if self.kernels is not None
                                  else "triton" if use_triton else "torch")
        paths = ForwardPaths()
        paths.pick("quantization", quantization or "none", quant_why)
        if self.dtype == torch.float32 and self.device.type == "cpu" and quantization is None:
            paths.pick("weights", "bfloat16" if self.weight_dtype else "float32",
                       "the checkpoint's bf16 weights held as shipped, widened to float32 in "
                       "registers by radixserve's GEMM (exact; half the bytes per step)"
                       if self.weight_dtype else f"widened to float32 at load: {bf16_no}")
        if dtype_change is not None:
            paths.pick("dtype", str(self.dtype).removeprefix("torch."), dtype_change)
            log.warning("--dtype auto: %s", dtype_change)
        if self.device.type == "cpu":
            release_free_heap()  # what resolving the model (a GGUF's conversion) freed
            tuned = tune_malloc(config.tune_malloc)
            paths.pick("malloc", "tuned" if tuned.applied else "default", tuned.reason)
        paths.pick("attention", self.attention_backend, *attention_reason(
            config.attention_backend, self.device, self.dtype, self.kernels is not None,
            use_triton, no_triton))
        if self.kernels is not None:
            paths.pick("attention_isa", *attention_isa(self.kernels, self.dtype))
        layer_ops, ops_path, ops_why = select_layer_ops(config.attention_backend, self.device)
        if ops_path is not None:
            paths.pick("layer_ops", ops_path, ops_why)
        # parameters made in the serving dtype on the device, filled a block of rows at a time
        # from the checkpoint: loading never holds the model in another dtype or on the host
        model = CausalLM(args, inv_freq, rope_scale, max(model_len, self.max_model_len) + 1,
                         self.kernels, self.attention_backend, self.shard, self.dtype,
                         self.device,
                         # a 4-bit checkpoint's weights arrive as ggml blocks, as a GGUF's do
                         "gguf" if quantization in ("awq", "gptq") else quantization,
                         None if quantization is None else _quant_kernels(self.kernels),
                         layer_ops, self.weight_dtype)
        weights = checkpoint_weights(files, args.num_heads, args.num_kv_heads)
        if args.int4 is not None:
            weights = int4_weights(weights, args.int4)
        model.load_weights(weights)
        self.model = model.eval()
        self.shadow = (ShadowChecker(reference_copy(self.model), config.shadow_rate, config.seed)
                       if config.shadow_rate > 0 else None)
        #: the packed linear kernel's row cap measured on this machine (None: not measured)
        self.kernel_rows: KernelRowsChoice | None = None
        self.packed_weights = self._pick_linears(config, paths)
        if self.device.type == "cpu":
            release_free_heap()  # the dense weights freed as their packed copies were made
        if "decode_layers" not in paths.paths:
            paths.pick("decode_layers", "per-op", "the fused stack needs packed bf16 linears")
        #: greedy rows' argmax: the C kernel's (3.3x torch's at 64 x 49,152) with the C kernels
        self._argmax = None if self.kernels is None else self.kernels.argmax_rows
        paths.pick("argmax", "torch" if self._argmax is None else "cpu",
                   "torch's argmax: the C kernels are not in use" if self._argmax is None
                   else "radixserve's C kernel, with the other C kernels (torch's with "
                        "--attention-backend torch)")
        self.paths = paths
        self.model.move_rope_tables(self.device)
        self.kv = KVStorage(args.num_layers, num_pages, page_size, kv_heads,
                          args.head_dim, self.dtype, self.device)
        #: the worker side of the KV connector (prefill/decode disaggregation), or None
        self.kv_connector = None
        if config.kv_transfer_config is not None:
            from radixserve.kv_transfer.factory import create_worker_connector

            self.kv_connector = create_worker_connector(config.kv_transfer_config, files.name)
            self.kv_connector.register_kv_caches(
                {f"model.layers.{i}.self_attn": t for i, t in enumerate(self.kv.layers)})
        self.page_size = page_size
        self._graph_config = config
        self.graphs = None
        if self.shard.size == 1:  # sharded: after join_group (the graphs hold its collectives)
            self._capture_graphs()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self.info = ModelInfo(
            name=files.name, folder=str(files.folder), max_model_len=self.max_model_len,
            vocab_size=args.vocab_size, eos_token_ids=eos_token_ids(files.folder, hf_config),
            dtype=str(self.dtype).removeprefix("torch."), device=str(self.device))
        log.info("loaded %s: %s on %s, %d KV pages x %d tokens (%.1f MiB)", files.name,
                 self.dtype, self.device, num_pages, page_size, num_pages * per_page / 2**20)
        for part, path in paths.paths.items():
            log.info("%s path: %s (%s)", part, path, paths.reasons[part])
        if self.shadow is not None:
            log.info("shadow checks: %.0f%% of steps re-run on the reference path "
                     "(SDPA, dense, eager)", 100 * config.shadow_rate)

    def _auto_gguf_form(self, config: EngineConfig, gguf: Path, a: ModelArgs
                        ) -> tuple[str | None, str]:
        """A GGUF with ``--quantization`` unset: in its blocks, or dequantized where that
        fits in memory and measured faster (``measured_gguf_form``)."""
        try:
            dense, _ = fit_dtype(config.dtype, resolve_dtype(config.dtype, self.device), a,
                                 self.device, self.shard.size)
        except ValueError as e:
            return "gguf", f"the GGUF served in its blocks: dequantized it would not fit ({e})"
        kernels = CpuKernels.load()
        if kernels is None:
            return None, "the GGUF is dequantized at load: the C kernels are unavailable"
        return measured_gguf_form(gguf, a, dense, min(config.max_num_seqs, 64), kernels)

    def _bf16_on_f32_gemm(self, config: EngineConfig, hint: int, model_key: str,
                          paths: ForwardPaths) -> bool:
        """A bfloat16 model's linears on the float32 GEMM over its bf16 weights
        (``EngineConfig.cpu_bf16_gemm``: asked for, or measured faster here); True when they
        were put there, with the paths recorded."""
        m = self.model
        if (self.dtype != torch.bfloat16 or not config.cpu_linear_kernel
                or config.cpu_bf16_gemm == "bf16" or self.kernels is None
                or self.kernels.f32_gemm_isa is None
                or any(w.shape[0] % 64 for w in self._dense_weights())):
            if config.cpu_bf16_gemm == "float32":
                log.warning("cpu_bf16_gemm=float32 not used: it needs a bfloat16 model, "
                            "cpu_linear_kernel, radixserve's float32 GEMM and output sizes "
                            "that are multiples of 64")
            elif config.cpu_bf16_gemm == "bf16" and self.dtype == torch.bfloat16:
                paths.pick("bf16_gemm", "bf16", "--cpu-bf16-gemm bf16")
            return False
        blocks = m.f32_k_blocks(self.kernels, hint)
        if config.cpu_bf16_gemm == "float32":
            reason = "--cpu-bf16-gemm float32"
        elif not cpu_has_native_bf16():
            # bf16 dot products would be emulated here, and float32 won the measurement on
            # such a CPU (the Ice Lake kind); measuring packs and times each form of a layer
            # and the LM head at start-up: 523-552 MiB added by loading a 300 MB bf16 folder
            # there, against 495 MiB unmeasured
            reason = ("this CPU has no bf16 dot products (no avx512_bf16 or amx_bf16): float32 "
                      "FMAs over the widened weights, not measured against emulated bf16")
        else:
            choice = choose_bf16_gemm(self.kernels, self._dense_weights, len(m.layers), hint,
                                      blocks, model_key)
            if choice.path == "bf16":
                paths.pick("bf16_gemm", "bf16", choice.reason)
                return False
            reason = choice.reason
        paths.pick("bf16_gemm", "float32", reason)
        self._use_bf16_weight_linears(config, hint, paths, ", rows widened and sums rounded "
                                      "back to bf16")
        return True

    def _use_bf16_weight_linears(self, config: EngineConfig, hint: int, paths: ForwardPaths,
                                 how: str = "") -> None:
        """Every projection and the LM head on the float32 GEMM over the bf16 weights
        (``CausalLM.use_bf16_weight_linears``), the fused decode stack over it; the paths
        recorded (``how``: what the activations go through, for the log)."""
        m = self.model
        assert self.kernels is not None
        m.use_bf16_weight_linears(self.kernels, hint)
        found = {f"{n}x{k}": kb for (n, k), kb in m.kernel_k_blocks.items()}
        paths.pick("linear", "bf16-weights", f"radixserve's float32 GEMM over the bf16 weights "
                   f"for every row count{how}: one reduction order per output, so rows do not "
                   "change with the batch")
        paths.pick("linear_kernel", "radixserve", f"K blocking per [N, K], oneDNN's float32 "
                   f"one where found (None: K): {found}")
        paths.pick("decode_layers", *enable_decode_stack(m, config.fused_decode))

    def _dense_weights(self) -> list[torch.Tensor]:
        """The first layer's four projections and the LM head, [N, K] each (measurements)."""
        m = self.model
        layer = m.layers[0]
        head = m.embed if m.lm_head is None else m.lm_head
        return [w.detach() for w in (layer.qkv, layer.o, layer.gate_up, layer.down, head)]

    def _pick_linears(self, config: EngineConfig, paths: ForwardPaths) -> bool:
        """Pack the linears or keep them dense (``--pack-weights``: on, off, or measured on
        this machine when unset); records the path and why. Returns True when packed."""
        if config.pack_weights is False:
            paths.pick("linear", "dense", "--no-pack-weights")
            return False
        if self.device.type != "cpu":
            paths.pick("linear", "dense", f"weights are packed on CPU only, not "
                       f"{self.device.type}")
            return False
        # tuned for decode-sized batches: prefill-sized calls lose only a few %
        hint = min(config.max_num_seqs, 64)
        m, a = self.model, self.args
        if m.quantization is not None:
            return self._pack_quantized(config, hint, paths)
        if self.weight_dtype is not None:
            self._use_bf16_weight_linears(config, hint, paths)
            return True
        amx_ok = False
        if (self.dtype == torch.bfloat16 and config.cpu_linear_kernel
                and config.cpu_bf16_gemm != "float32"  # asked for by name: it wins
                and self.kernels is not None and self.kernels.amx.available):
            amx_ok, amx_why = self.kernels.amx.self_check()
            if not amx_ok:
                log.warning("AMX GEMM not used: %s", amx_why)
        if amx_ok:
            m.use_amx_linears(self.kernels.amx)
            paths.pick("linear", "amx", "radixserve's AMX bfloat16 GEMM for every row count: one "
                       "reduction order per output, so rows do not change with the batch "
                       "(oneDNN's AMX GEMM picks its K blocking by M; --no-cpu-linear-kernel "
                       "runs it)")
            paths.pick("decode_layers", *enable_decode_stack(m, config.fused_decode))
            return True
        layer = m.layers[0]
        model_key = (f"{a.arch} {a.hidden_size} {a.intermediate_size} {a.num_heads} "
                     f"{a.num_kv_heads} {a.head_dim} {a.vocab_size} {self.dtype}"
                     + (f" tp{self.shard.size}" if self.shard.size > 1 else ""))
        if self._bf16_on_f32_gemm(config, hint, model_key, paths):
            return True
        invariant = (config.cpu_linear_kernel and self.kernels is not None
                     and self.kernels.has_linear_kernel(self.dtype))
        if config.pack_weights is None and config.speculative_config is not None and invariant:
            # dense F.linear (MKL) rounds a row differently with the batch around it, so a
            # verify row would not compute a decode row's bits and greedy output would change
            # with speculation; the packed kernel's rows do not depend on the batch
            reason = ("speculative decoding: packed weights on radixserve's kernel, whose "
                      "rows do not depend on the batch (not measured against dense)")
        elif config.pack_weights is None:
            head = m.embed if m.lm_head is None else m.lm_head
            choice = choose_linear_path(
                [layer.qkv.detach(), layer.o.detach(), layer.gate_up.detach(),
                 layer.down.detach(), head.detach()], hint, model_key)
            if choice.path == "dense":
                paths.pick("linear", "dense", choice.reason)
                return False
            reason = choice.reason
        else:
            reason = "--pack-weights"
        rows = None
        if invariant:
            assert self.kernels is not None
            rows = self.kernel_rows = choose_kernel_rows(
                self.kernels, self.dtype,
                [w.detach() for w in (layer.qkv, layer.o, layer.gate_up, layer.down)],
                hint, m.kernel_k_blocks, model_key)
        if self.device.type == "cpu":
            release_free_heap()  # the measurements' packed copies and activations, before packing
        if self.model.pack_linears(batch_hint=hint, linear_kernel=config.cpu_linear_kernel,
                                   kernel_max_rows=None if rows is None else rows.max_rows):
            paths.pick("linear", "packed", reason)
            path, why = self._linear_kernel_reason(config, rows)
            # a shape the kernel could not reproduce on a machine that has it: a fall-back
            fell_back = any(kb is None for kb in self.model.kernel_k_blocks.values())
            paths.pick("linear_kernel", path, why, fallback=fell_back)
            paths.pick("decode_layers", *enable_decode_stack(self.model, config.fused_decode))
            return True
        paths.pick("linear", "dense", "oneDNN packing unavailable in this torch build",
                   fallback=True)
        return False

    def _pack_quantized(self, config: EngineConfig, hint: int, paths: ForwardPaths) -> bool:
        """A quantized model: its blocks stay as they are; dense rest (an embedding-tied LM
        head under int8, norms aside) is packed for oneDNN. Records the formats held."""
        m = self.model
        kinds: dict[str, int] = {}
        for layer in m.layers:
            for method in layer.quantized.values():
                kinds[method.kind] = kinds.get(method.kind, 0) + 1
        head = "dense" if m.lm_head_q is None else m.lm_head_q.kind
        embed = "dense" if m.embed_q is None else m.embed_q.kind
        packed = m.pack_linears(batch_hint=hint)
        quant = m.quant  # the model's own (``_quant_kernels``, given at construction)
        tiles = f"{quant.isa} block kernels" + (
            ", integer dots on AMX-INT8 tiles from 16 rows" if quant.amx_int8 else "")
        paths.pick("linear", "quantized", f"projections {kinds}, LM head {head}, embedding "
                   f"{embed} ({tiles}); dense rest "
                   f"{'packed for oneDNN' if packed else 'F.linear'}")
        paths.pick("decode_layers", *enable_decode_stack(m, config.fused_decode))
        return packed

    def _linear_kernel_reason(self, config: EngineConfig,
                              rows: KernelRowsChoice | None) -> tuple[str, str]:
        """Which kernel runs decode-sized packed linears (``packed_kernel``)
        ("radixserve" where every projection and the LM head took radixserve's, "mixed" where
        some did, else "onednn") and why."""
        if not config.cpu_linear_kernel:
            return "onednn", ("--no-cpu-linear-kernel: oneDNN's GEMM (one row as two equal "
                              "rows)")
        blocks = self.model.kernel_k_blocks
        if not blocks:
            return "onednn", ("oneDNN's GEMM: radixserve's needs weights without bias and the C "
                              "kernels built with AVX512-BF16 (bf16) or AVX2 + FMA (float32)")
        used = {f"{n}x{k}": kb for (n, k), kb in blocks.items()}
        path = ("radixserve" if all(kb is not None for kb in blocks.values())
                else "mixed" if any(kb is not None for kb in blocks.values()) else "onednn")
        cap = ("" if rows is None or path == "onednn"
               else f"; calls of more rows go to oneDNN: {rows.reason}")
        return path, (f"radixserve's GEMM over oneDNN's packed weights for decode-sized "
                      f"calls, bit-identical to its GEMM, K blocking per [N, K] (None: "
                      f"oneDNN): {used}{cap}")

    def stats(self) -> RunnerStats:
        """The paths in use, steps run and shadow-check counts (cumulative)."""
        p = self.paths
        return RunnerStats(paths=dict(p.paths), fallbacks=dict(p.fallbacks), steps=p.steps,
                           shadow=None if self.shadow is None
                           else msgspec.structs.replace(self.shadow.stats))

    def _metadata(self, batch: ForwardBatch, kernels: bool | None = None) -> AttentionMetadata:
        """The step's attention metadata in the layout of an attention backend: this runner's
        (``kernels`` None), the C kernels' (True) or SDPA's (False, the reference).

        Decodes get a page table plus lengths (host lengths for the C kernel, device lengths
        for Triton) or, for SDPA, key masks. Each token of a request verifying draft tokens
        (speculative decoding) is a decode row of its own: its request's pages, its position
        + 1 keys. That is the decode row the token would be without speculation, so its bits
        are a decode's on every backend, and a step of decodes and verifies runs where decode
        steps run (the fused decode stack). Prefill chunks are listed one by one; for Triton
        they are also packed into two device tensors (one copy each per step)."""
        backend = (self.attention_backend if kernels is None
                   else "cpu" if kernels else "torch")
        dev, ps = self.device, self.page_size
        d = dv = batch.num_decodes  # decode rows (tokens); first prefill request
        req_of = np.arange(d)
        seq = batch.seq_lens[:d]
        if batch.num_draft is not None:
            nd = batch.num_draft[d:]
            dv = d + int(np.count_nonzero(nd))  # verify requests follow the decodes
            new = batch.num_new[d:dv]
            req_of = np.concatenate([req_of, np.repeat(np.arange(d, dv), new)])
            # token j of a verify request sees its context up to and including itself
            first = np.repeat(batch.seq_lens[d:dv] - new, new)
            seq = np.concatenate([seq, first + 1 + np.arange(int(new.sum()))
                                  - np.repeat(np.cumsum(new) - new, new)])
            d = len(req_of)
        pt, pd_lens, pd_mask = None, None, None
        if d:
            n_pages = int(-(-seq.max() // ps))
            rows = batch.page_table[:d, :n_pages] if dv == d else batch.page_table[req_of, :n_pages]
            pt = torch.from_numpy(rows.astype(np.int64)).to(dev)
            if backend == "torch":
                keys = np.arange(n_pages * ps)[None, :] < seq[:, None]
                pd_mask = torch.from_numpy(keys).to(dev)[:, None, None, :]
            else:
                pd_lens = torch.from_numpy(seq.astype(np.int64))
                if backend == "triton":
                    pd_lens = pd_lens.to(dev)
        prefill = []
        ends = np.cumsum(batch.num_new)
        pt_np = batch.page_table
        bounds = table = None
        max_q = 0
        if backend == "triton" and batch.num_requests > dv:
            ctxs = batch.seq_lens[dv:].astype(np.int64)
            lens = batch.num_new[dv:].astype(np.int64)
            starts = ends[dv:].astype(np.int64) - lens
            bounds = torch.from_numpy(np.stack([starts, lens, ctxs], axis=1)).to(dev)
            width = int(-(-ctxs.max() // ps))
            table = torch.from_numpy(pt_np[dv:, :width].astype(np.int64)).to(dev)
            max_q = int(lens.max())
        for i in range(dv, batch.num_requests):
            ctx = int(batch.seq_lens[i])
            n = -(-ctx // ps)
            pages = (table[i - dv, :n] if table is not None
                     else torch.from_numpy(pt_np[i, :n].astype(np.int64)).to(dev))
            end = int(ends[i])
            prefill.append((end - int(batch.num_new[i]), end, ctx, pages))
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(batch.slot_mapping).to(dev), num_decodes=d,
            decode_page_table=pt, decode_seq_lens=pd_lens, decode_mask=pd_mask,
            prefill=prefill, prefill_bounds=bounds, prefill_page_table=table,
            prefill_max_q_len=max_q)

    def join_group(self, group: TensorParallelGroup) -> None:
        """Run this shard's collectives over ``group`` (tensor parallelism), then capture the
        decode graphs (every rank captures the same buckets in the same order, so the
        collectives recorded in them pair up)."""
        self.model.join_group(group)
        self._capture_graphs()

    def _capture_graphs(self) -> None:
        """CUDA graphs of decode steps (``cuda_graphs``); nothing on CPU or with
        ``enforce_eager``."""
        config, paths = self._graph_config, self.paths
        self.graphs = maybe_decode_graphs(
            self.model, self.kv.layers, self.page_size, self.max_model_len,
            config.cuda_graph_max_bs or min(config.max_num_seqs, 256), self.attention_backend,
            config.enforce_eager, lambda why: paths.pick("cuda_graphs", "eager", why, True))
        if self.graphs is not None:
            paths.pick("cuda_graphs", "captured",
                       f"decode steps of batch sizes {self.graphs.buckets}")

    @torch.inference_mode()
    def forward_logits(self, batch: ForwardBatch
                       ) -> tuple[torch.Tensor | None, list[list[list[float]]] | None]:
        """The step's forward: KV written, float32 logits [S, vocab] of its sampling rows
        (None when no row samples) and its prompt logprob rows (None when none were asked).
        Every tensor-parallel rank runs this for every step (its collectives pair up)."""
        if self.graphs is not None and self.graphs.can_run(batch):
            self.paths.steps += 1
            return self.graphs.run(batch), None
        meta = self._metadata(batch)
        ids = torch.from_numpy(batch.input_ids).to(self.device)
        pos = torch.from_numpy(batch.positions).to(self.device)
        hidden = self.model(ids, pos, self.kv.layers, meta)
        self.paths.steps += 1
        plp = (None if batch.prompt_logprobs is None else
               prompt_logprob_rows(self.model.compute_logits, hidden, batch.prompt_logprobs))
        if not len(batch.logits_indices):
            return None, plp
        idx = torch.from_numpy(batch.logits_indices).to(self.device)
        logits = self.model.compute_logits(hidden[idx])
        if self.shadow is not None and self.shadow.wants_step():
            self.shadow.check(ids, pos, self.kv.layers, lambda: self._metadata(batch, False),
                              idx, logits)
        return logits, plp

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> SampleResult:
        """Run the step's forward and sample one token per sampling row.

        Returns: int64 [S] tokens (S = ``batch.logits_indices`` length) and logprob rows."""
        logits, plp = self.forward_logits(batch)
        if logits is None:
            return SampleResult(np.empty(0, np.int64), None, prompt_logprobs=plp)
        result = sample(logits, batch.sampling, self.generator, self._argmax)
        result.prompt_logprobs = plp
        return result

