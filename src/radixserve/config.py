"""Engine configuration: one dataclass whose fields are the offline ``LLM`` arguments and the
``radixserve serve`` engine flags (the CLI generates its flags from these fields)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("fcfs", "lpm")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
#: ``--quantization`` (vLLM's flag): "gguf" serves a GGUF's blocks, "int8" quantizes a float
#: checkpoint's linears at load, "awq" / "gptq" serve such a 4-bit checkpoint's weights (the
#: default for one), "none" keeps every weight dense
QUANTIZATIONS = ("gguf", "int8", "awq", "gptq", "none")
#: the arithmetic of a bfloat16 model's linears on CPU (``EngineConfig.cpu_bf16_gemm``)
BF16_GEMMS = ("auto", "bf16", "float32")
#: KV connectors ``kv_transfer_config.kv_connector`` may name (``kv_transfer/factory.py``).
KV_CONNECTORS = ("NixlConnector", "TcpConnector")
#: Roles of an instance in prefill/decode disaggregation (vLLM's ``kv_role`` values).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
#: What a decode instance does when it cannot load a prompt's KV (vLLM's values).
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


def _json_fields(cls: type, value: dict[str, Any] | str, flag: str) -> dict[str, Any]:
    """A JSON-object flag's value (a dict, or its JSON text) as the dataclass ``cls``'s
    fields.

    Raises:
        ValueError: not JSON, not an object, or a field ``cls`` does not have (named, with
            the known ones).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{flag}: unknown field {unknown[0]!r} "
                         f"(known: {', '.join(sorted(known))})")
    return value

@dataclass
class KVTransferConfig:
    """Prefill/decode disaggregation: the JSON of ``--kv-transfer-config`` (vLLM's flag and
    field names) or the offline ``LLM(kv_transfer_config=...)``.

    Attributes:
        kv_connector: "NixlConnector" (KV pages read over NIXL/UCX) or "TcpConnector" (read
            over a ZeroMQ TCP socket; needs no NIXL).
        kv_role: "kv_producer" (prefill only), "kv_consumer" (decode only) or "kv_both".
        engine_id: this instance's id in ``kv_transfer_params`` (default: a fresh uuid4 hex).
        kv_ip: address the side channel (handshake, leases, TCP reads) binds and advertises as
            ``remote_host``.
        kv_port: its TCP port; 0 picks a free one (advertised as ``remote_port``).
        kv_buffer_device: where transferred KV lives; only "cpu" (the KV pool's own memory) or
            "cuda" on a CUDA device are accepted.
        kv_load_failure_policy: "recompute" (the decode instance computes the prompt itself
            when the prefill instance's KV cannot be read) or "fail" (the request ends with an
            error).
        kv_lease_s: seconds a prefill instance keeps a finished request's pages for the decode
            instance to read (renewed once when the decode side claims them); pages are freed
            at the decode side's notification or at expiry (vLLM's
            ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s there too).
        kv_connector_extra_config: connector options: ``backends`` (NIXL backends, ["UCX"]),
            ``side_channel_timeout_s`` (seconds a side-channel call may take, 5),
            ``load_delay_s`` (fault injection: seconds a decode read waits before it starts,
            0).

    Raises:
        ValueError: from ``validate``: an unknown field or a bad value, naming it.
    """

    kv_connector: str = "NixlConnector"
    kv_role: str = "kv_both"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_buffer_device: str = "cpu"
    kv_load_failure_policy: str = "recompute"
    kv_lease_s: float = 480.0
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    #: keys ``kv_connector_extra_config`` may hold
    EXTRA_KEYS = ("backends", "side_channel_timeout_s", "load_delay_s")

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_producer(self) -> bool:
        """This instance may prefill for a remote decode (``do_remote_decode``)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """This instance may decode after a remote prefill (``do_remote_prefill``)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str, default: Any) -> Any:
        """``kv_connector_extra_config[key]`` or ``default``."""
        return self.kv_connector_extra_config.get(key, default)

    def validate(self) -> None:
        """Raises ValueError naming the field (``kv_transfer_config.<field>``)."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"kv_transfer_config.{name}={getattr(self, name)!r} {why}")

        if self.kv_connector not in KV_CONNECTORS:
            raise bad("kv_connector", f"is not one of {', '.join(KV_CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise bad("kv_role", f"is not one of {', '.join(KV_ROLES)}")
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise bad("engine_id", "must be a non-empty string")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise bad("kv_ip", "must be a host name or address")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port <= 65535:
            raise bad("kv_port", "must be in [0, 65535]")
        if self.kv_buffer_device not in ("cpu", "cuda"):
            raise bad("kv_buffer_device", "must be cpu or cuda")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise bad("kv_load_failure_policy",
                      f"is not one of {', '.join(KV_LOAD_FAILURE_POLICIES)}")
        if isinstance(self.kv_lease_s, bool) or not isinstance(self.kv_lease_s, (int, float)) \
                or not self.kv_lease_s > 0:
            raise bad("kv_lease_s", "must be a number of seconds > 0")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise bad("kv_connector_extra_config", "must be a JSON object")
        unknown = sorted(set(extra) - set(self.EXTRA_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown key "
                             f"{unknown[0]!r} (known: {', '.join(self.EXTRA_KEYS)})")
        for key in ("side_channel_timeout_s", "load_delay_s"):
            v = extra.get(key, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{key}={v!r} "
                                 f"must be a number of seconds >= 0")
        backends = extra.get("backends", ["UCX"])
        if not isinstance(backends, list) or not all(isinstance(b, str) for b in backends):
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config.backends="
                             f"{backends!r} must be a list of NIXL backend names")

    @classmethod
    def parse(cls, value: KVTransferConfig | dict[str, Any] | str) -> KVTransferConfig:
        """A config from itself, a dict or a JSON object string (the CLI flag's value).

        Raises:
            ValueError: not JSON, not an object, an unknown field or a bad value.
        """
        if isinstance(value, cls):
            return value
        value = _json_fields(cls, value, "kv_transfer_config")
        kw = {k: v for k, v in value.items() if not (k == "engine_id" and v is None)}
        return cls(**kw)


#: ``speculative_config.method`` values (vLLM's names): "ngram" (prompt lookup) and
#: "draft_model" (a second, smaller model sharing the target's tokenizer).
SPEC_METHODS = ("ngram", "draft_model")
#: ``speculative_config.disable_by_batch_size`` when the JSON leaves it out: the engine takes
#: its device's measured crossover (``core.spec_decode.crossover_batch_size``). Distinct from
#: an explicit null, which keeps vLLM's meaning (draft at every batch size).
SPEC_BATCH_AUTO = "auto"


@dataclass
class SpeculativeConfig:
    """Speculative decoding: the JSON of ``--speculative-config`` (vLLM's flag and field names)
    or the offline ``LLM(speculative_config=...)``.

    Each step a running request (one without an output constraint) may carry up to
    ``num_speculative_tokens`` draft tokens, proposed by prompt lookup over its own prompt and
    output (the n-gram method) or by k greedy steps of a draft model (the draft-model
    method); the model verifies them in one forward and keeps the longest
    prefix equal to its own picks (the argmax, or for a sampled request rejection sampling,
    which keeps the target's distribution), plus its token at the first mismatch (or the
    bonus token when every draft matched).

    Attributes:
        method: "ngram" (prompt lookup) or "draft_model" (``model`` drafts greedily).
        num_speculative_tokens: draft tokens per request and step (k), >= 1.
        prompt_lookup_min / prompt_lookup_max: the suffix n-gram lengths (in tokens) searched
            for earlier in the request's tokens, longest first; 1 <= min <= max. vLLM's
            defaults: one left out takes the other's value, both left out are 5.
        model: the draft model of the "draft_model" method (what ``EngineConfig.model``
            accepts: a Hugging Face folder or a GGUF file); required by that method and
            refused by the other. It must share the target's tokenizer (checked at start-up:
            ``model_executor.draft``).
        disable_by_batch_size: no drafts in a step with more running requests than this
            (vLLM's field): a verify step costs more than it saves once a batch is
            compute-bound. Left out (or "auto"): the crossover measured for the engine's
            device (``core.spec_decode.crossover_batch_size``: 1 on CPU and on CUDA); None
            (JSON null, vLLM's default) drafts at every batch size; an integer >= 1 is kept.
        adaptive_draft_length: True (default): each step a request drafts the number of
            tokens, from 0 to ``num_speculative_tokens``, that gives it the most tokens per
            unit of step time, from its own acceptance so far and the step times the engine
            measures (``core.spec_decode.DraftLengthRule``); False (vLLM's behaviour): always
            up to ``num_speculative_tokens``.

    Raises:
        ValueError: from ``validate`` / ``parse``: an unknown field, a bad value or a method
            not implemented, naming ``speculative_config.<field>``.
    """

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | str | None = SPEC_BATCH_AUTO
    adaptive_draft_length: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Fill vLLM's n-gram defaults and check every field.

        Raises:
            ValueError: naming ``speculative_config.<field>`` and what is allowed.
        """
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"speculative_config.{name}={getattr(self, name)!r} {why}")

        if self.method not in SPEC_METHODS:
            raise bad("method", f"is not one of {', '.join(SPEC_METHODS)}")
        if self.method == "draft_model":
            if not self.model:
                raise bad("model", "must name the draft model (a folder or GGUF file) for "
                                   "the draft_model method")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise bad(name, "belongs to the ngram method, not draft_model")
        elif self.model is not None:
            raise bad("model", "is for the draft_model method; the ngram method has no model")
        if self.num_speculative_tokens is None:
            raise bad("num_speculative_tokens", "must be given (draft tokens per step, >= 1)")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size"):
            v = getattr(self, name)
            if name == "disable_by_batch_size" and v == SPEC_BATCH_AUTO:
                continue
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise bad(name, "must be an integer >= 1"
                          + (', null or "auto"' if name == "disable_by_batch_size" else ""))
        if not isinstance(self.adaptive_draft_length, bool):
            raise bad("adaptive_draft_length", "must be true or false")
        if self.method != "ngram":
            return
        # vLLM's rule: one bound given, the other follows it; neither, max 5 and min 5
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if lo > hi:
            raise bad("prompt_lookup_min", f"must be <= prompt_lookup_max ({hi})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """A config from itself, a dict or a JSON object string (the CLI flag's value).

        Raises:
            ValueError: not JSON, not an object, an unknown field, a bad value or a method not
                implemented.
        """
        if isinstance(value, cls):
            return value
        return cls(**_json_fields(cls, value, "speculative_config"))


@dataclass
class EngineConfig:
    """Everything the engine core needs to start.

    Attributes:
        model: HF folder, GGUF file, or None for the default model (SmolLM2-135M-Instruct).
        dtype: "auto" (bfloat16 on CUDA and on CPUs with native bf16 matmul, else float32),
            "float32", "bfloat16" or "float16".
        device: "cpu", "cuda" or "auto" (cuda when available).
        page_size: tokens per KV page (1 gives token-granular prefix reuse).
        num_pages: KV pages in the pool; None sizes it from ``kv_cache_memory``.
        kv_cache_memory: KV pool budget in bytes when ``num_pages`` is None.
        max_num_seqs: most requests in one batch.
        max_num_batched_tokens: token budget of one step (decodes + prefill chunks).
        max_model_len: longest sequence (prompt + output) in tokens; None takes the model's.
        enable_prefix_caching: radix prefix cache; False uses the naive cache.
        schedule_policy: "fcfs" or "lpm" (longest prefix match first, SGLang's cache-aware policy).
        disable_overlap: True runs schedule and forward one after the other; False runs the
            forward in a worker thread while the next step is scheduled (overlap scheduling);
            None (default) picks overlap on CUDA and no overlap on CPU, where forward and
            scheduler share the same cores and the forward measured 10-20% slower with a second
            busy thread beside it (docs/benchmarks.md).
        step_timers: record per-step schedule/prepare/forward/output timings.
        seed: seed of the engine-wide generator (requests without their own seed).
        num_threads: torch intra-op threads; None leaves torch's default.
        attention_backend: "auto" (radixserve's C kernels on CPU when they build; its Triton
            kernels on CUDA when ``triton`` imports; else SDPA), "cpu" (the C kernels or an
            error), "triton" (the Triton paged-attention kernels or an error: CUDA, or CPU
            in Triton's interpreter with ``TRITON_INTERPRET=1`` for tests; element-wise steps
            in torch ops) or "torch" (SDPA over gathered pages, the reference).
        pack_weights: on CPU, pack linear weights once into oneDNN's layout (faster matmuls at
            decode batch sizes; the dense copies are freed). None (default): packed or dense,
            whichever measured faster on this machine and model (``path_choice``, cached);
            True/False force it. Ignored on CUDA.
        cpu_linear_kernel: with packed weights, run linears of decode-sized calls (up to the
            row cap measured against oneDNN at start-up, at most 512 rows:
            ``path_choice.choose_kernel_rows``) through radixserve's C kernel over oneDNN's
            packed weights (bf16 with AVX512-BF16, float32 with AVX2 + FMA), where it
            reproduces oneDNN's GEMM bit for bit (checked per shape at load,
            ``layers/packed_kernel.py``); on a CPU with AMX, in bfloat16, radixserve's AMX
            GEMM for every call instead (``layers/amx_linear.py``: oneDNN's AMX GEMM cannot be
            reproduced and changes a row's bits with the batch); False
            (``--no-cpu-linear-kernel``): oneDNN's GEMM for every call (one row as two equal
            rows), the reference.
        cpu_bf16_gemm: a bfloat16 model's linears on CPU: "bf16" (bf16 pair dot products,
            ``vdpbf16ps``: radixserve's kernel and oneDNN, as ``cpu_linear_kernel`` says; on
            the AMX kind its AMX GEMM, as with "auto"), "float32" (on every kind, AMX
            included: radixserve's float32 GEMM over the bf16 weights, the rows
            widened and the sums rounded back to bf16, ``layers/bf16_weight_linear.py``: one
            reduction order for every row count, the float32 oneDNN path's arithmetic), or
            "auto" (default): the AMX GEMM on the AMX kind, "float32" unmeasured on a CPU
            without bf16 dot products (no ``avx512_bf16``: bf16 would be emulated there),
            elsewhere whichever measured faster on one layer and the LM head at start-up
            (``path_choice.choose_bf16_gemm``, cached). Some CPUs run float32 FMAs
            at twice the rate of their bf16 dot products. Needs ``cpu_linear_kernel``.
        fused_decode: run a decode step's layers in one call into radixserve's C kernels
            (the same kernels in the same order as the per-op path, so the same bits) where
            the model allows it: weights on ``cpu_linear_kernel``, the "cpu" attention
            backend, no tensor parallelism (``models/decode_stack.py``); False
            (``--no-fused-decode``): one call per op, the reference.
        tune_malloc: on CPU, raise glibc's mmap and trim thresholds at start-up so that each
            step's activations reuse heap memory instead of page-faulting fresh pages
            (``model_executor/cpu_malloc.py``; skipped where the environment already sets
            glibc's malloc variables or preloads tcmalloc/jemalloc). Ignored on CUDA.
        shadow_rate: fraction of steps (0..1) re-run on the reference path (SDPA attention,
            dense linears, eager) and compared with the fast path, counted in ``/metrics``;
            never served. 0 (default) turns shadow checks off; above 0 the reference keeps a
            second copy of the weights.
        kv_transfer_config: prefill/decode disaggregation (a ``KVTransferConfig``, or its
            dict / JSON string, converted on construction); None: off.
        tensor_parallel_size: ranks the model is split over (``--tensor-parallel-size``, vLLM's
            flag): sibling processes under ``torch.distributed`` (Gloo on CPU, NCCL on CUDA,
            ``cuda:r`` for rank r); rank 0 runs the scheduler and broadcasts each step's
            inputs. It must divide the model's query heads and intermediate size, and divide or
            be a multiple of its KV heads (KV heads are then replicated). ``kv_cache_memory``
            is per rank. Not combinable with ``shadow_rate`` or ``kv_transfer_config`` yet.
        enforce_eager: on CUDA, run every step eagerly instead of replaying decode steps from
            CUDA graphs (vLLM's flag). Ignored on CPU, which never captures.
        cuda_graph_max_bs: largest decode batch captured in a CUDA graph (SGLang's flag); None
            takes ``max_num_seqs`` capped at 256. Larger decode batches run eagerly.
        generation_config: the sampling defaults of requests that leave them unset (vLLM's
            flag): "auto" reads the model's ``generation_config.json`` (temperature, top_p,
            top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), "vllm" uses
            none (vLLM's and OpenAI's defaults), a folder reads its
            ``generation_config.json``. Applied by the frontends, not the engine core.
        quantization: how linear weights are held (vLLM's ``--quantization``): None picks,
            for a GGUF file on CPU, "gguf" or "none", whichever measured faster on this
            machine (cached; "gguf" where the dequantized weights would not fit), else dense;
            "gguf" serves the file's quantized
            blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) through radixserve's
            kernels; "int8"
            quantizes a float checkpoint's projections and LM head to int8 per output channel
            at load (weight-only);
            "awq" / "gptq" serve a 4-bit AWQ / GPTQ checkpoint's weights as ggml blocks (the
            default for such a checkpoint on CPU); "none" holds every weight dense in
            ``dtype`` (a GGUF or a 4-bit checkpoint dequantized at load).
        speculative_config: speculative decoding (a ``SpeculativeConfig``, or its dict / JSON
            string, converted on construction); None: off. Steps then run without overlap
            (``disable_overlap`` None means off; False is refused).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory: int = 2 * 1024**3
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    schedule_policy: str = "fcfs"
    disable_overlap: bool | None = None
    step_timers: bool = False
    seed: int = 0
    num_threads: int | None = None
    attention_backend: str = "auto"
    pack_weights: bool | None = None
    cpu_linear_kernel: bool = True
    cpu_bf16_gemm: str = "auto"
    fused_decode: bool = True
    tune_malloc: bool = True
    shadow_rate: float = 0.0
    kv_transfer_config: KVTransferConfig | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    cuda_graph_max_bs: int | None = None
    quantization: str | None = None
    generation_config: str = "auto"
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the field and the allowed values."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device={self.device!r} must be auto, cpu or cuda[:N]")
        if self.page_size < 1:
            raise ValueError(f"page_size={self.page_size} must be >= 1")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages} must be >= 2")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory} must be > 0 bytes")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if not 0.0 <= self.shadow_rate <= 1.0:
            raise ValueError(f"shadow_rate={self.shadow_rate} must be in [0, 1]")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy={self.schedule_policy!r} is not one of "
                             f"{', '.join(SCHEDULE_POLICIES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not one of "
                             f"{', '.join(QUANTIZATIONS)}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs={self.cuda_graph_max_bs} must be >= 1")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be >= 1")
        if self.tensor_parallel_size > 1 and self.shadow_rate > 0:
            raise ValueError("shadow_rate > 0 is not supported with tensor_parallel_size > 1")
        if self.tensor_parallel_size > 1 and self.kv_transfer_config is not None:
            raise ValueError("kv_transfer_config (prefill/decode disaggregation) is not "
                             "supported with tensor_parallel_size > 1")
        if self.cpu_bf16_gemm not in BF16_GEMMS:
            raise ValueError(f"cpu_bf16_gemm={self.cpu_bf16_gemm!r} is not one of "
                             f"{', '.join(BF16_GEMMS)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is not one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_model" and (
                self.tensor_parallel_size > 1 or self.kv_transfer_config is not None):
            # the draft's KV pool mirrors one unsharded pool; loaded pages would lack draft KV
            raise ValueError("speculative_config with the draft_model method is not supported "
                             "with tensor_parallel_size > 1 or kv_transfer_config yet")
        if self.speculative_config is not None and self.disable_overlap is False:
            raise ValueError("speculative_config needs steps run one after the other: "
                             "disable_overlap=False (--no-disable-overlap) cannot be combined "
                             "with it (the next step is scheduled before this one's accepted "
                             "tokens are known)")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


#: Largest request body the HTTP server accepts by default (bytes).
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024**2
#: ``--tool-call-parser`` values (vLLM's names; read by ``entrypoints.openai.tool_calls``).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


@dataclass
class ServerConfig:
    """HTTP server settings of ``radixserve serve`` (the engine's are in ``EngineConfig``).

    Attributes:
        host: address to bind; 127.0.0.1 unless told otherwise.
        port: TCP port.
        api_key: when set, every ``/v1/*`` request needs ``Authorization: Bearer <api_key>``.
        max_request_bytes: larger request bodies get 413.
        max_concurrent_requests: generation requests in flight at most; one more gets 429
            (None: no limit; the engine queues).
        served_model_name: the model name clients use (None: the model's own name).
        null_model: serve a null model (fixed token, no weights) to measure server overhead.
        null_step_ms: with ``null_model``, milliseconds each engine step takes (0: instant).
        graceful_timeout_s: seconds a SIGTERM/SIGINT shutdown may take before children are
            killed.
        shutdown_timeout_s: seconds in-flight requests may run after SIGTERM while new ones
            get 503 (vLLM's ``--shutdown-timeout``); what still runs is then aborted.
        log_requests: one log line per finished request (``--disable-log-requests`` off).
        log_stats: a throughput/occupancy line every ``log_stats_interval_s`` seconds
            (``--disable-log-stats`` off).
        log_stats_interval_s: seconds between stats lines.
        log_format: "text" or "json" (one JSON object per line).
        log_prompts: include the prompt text in request lines (never logged otherwise).
        extra_model_names: more names clients may use (``--served-model-name`` after the
            first); each is listed by /v1/models.
        chat_template: a Jinja chat template that replaces the tokenizer's (the text of
            ``--chat-template``), or None.
        tool_call_parser: the format "auto" tool calls are read in (``TOOL_CALL_PARSERS``;
            None: Hermes, radixserve's default).
        enable_auto_tool_choice: ``tool_choice`` "auto" with ``tool_call_parser`` (vLLM's
            ``--enable-auto-tool-choice``; it needs a parser).
        allowed_origins: CORS origins (``*`` for any); None: no CORS headers at all.
        allow_credentials / allowed_methods / allowed_headers: the rest of the CORS policy
            (vLLM's flags), used only with ``allowed_origins``.
        ssl_keyfile / ssl_certfile / ssl_ca_certs: serve HTTPS (uvicorn's; key and
            certificate come together; CA certificates to verify clients, optional).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_concurrent_requests: int | None = None
    served_model_name: str | None = None
    null_model: bool = False
    null_step_ms: float = 0.0
    graceful_timeout_s: float = 3.0
    shutdown_timeout_s: float = 30.0
    log_requests: bool = True
    log_stats: bool = True
    log_stats_interval_s: float = 10.0
    log_format: str = "text"
    log_prompts: bool = False
    extra_model_names: tuple[str, ...] = ()
    chat_template: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    allowed_origins: tuple[str, ...] | None = None
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            # vLLM's rule and words
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} is not one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both "
                             "the key and its certificate)")
        if self.ssl_ca_certs is not None and self.ssl_keyfile is None:
            raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} must be in [0, 65535]")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes={self.max_request_bytes} must be >= 1")
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError(
                f"max_concurrent_requests={self.max_concurrent_requests} must be >= 1")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout_s={self.shutdown_timeout_s} must be >= 0")
        if self.log_stats_interval_s <= 0:
            raise ValueError(
                f"log_stats_interval_s={self.log_stats_interval_s} must be > 0 seconds")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format={self.log_format!r} is not one of text, json")
