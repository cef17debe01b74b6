"""What a gateway asks a worker about itself, shared by the HTTP worker endpoints
(``openai/worker_info.py``) and the gRPC worker (``grpc_worker/``): model facts, server facts and
the load report, as plain dicts keyed with the names smg reads.

Field names follow the shapes smg (the Shepherd Model Gateway) parses: SGLang's ``/server_info``
and ``/model_info`` (``model_gateway/src/workflow/steps/local/discover_metadata.rs``), SGLang's
``/v1/loads`` (``WorkerLoadResponse``: ``{"timestamp", "dp_rank_count", "loads": [...]}``) and
vLLM's ``GetModelInfoResponse`` / ``SchedulerLoad`` in ``smg-grpc-proto``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec

import radixserve
from radixserve.config import EngineConfig
from radixserve.engine_types import EngineInfo, SchedulerStats

#: What ``server_type`` / ``runtime`` says about this engine.
ENGINE_NAME = "radixserve"


def _hf_config(folder: str) -> dict[str, Any]:
    """The model folder's ``config.json`` as a dict ({} when unreadable: only labels use it)."""
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _first_id(value: Any) -> int:
    """A token id from a config value that may be an int, a list of ints or missing (-1)."""
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) else -1


@dataclass(frozen=True)
class ModelFacts:
    """The loaded model as a gateway sees it.

    Attributes:
        served_model_name: the name clients use.
        model_path: the model as given on the command line (or the folder it was loaded from).
        tokenizer_path: the folder holding the tokenizer files.
        max_context_length: ``max_model_len``, tokens.
        vocab_size: token ids are below it.
        model_type / architectures: from the folder's ``config.json``.
        eos_token_ids: ids that end generation.
        bos_token_id / pad_token_id: from ``config.json``; -1 when it has none.
    """

    served_model_name: str
    model_path: str
    tokenizer_path: str
    max_context_length: int
    vocab_size: int
    model_type: str
    architectures: list[str]
    eos_token_ids: list[int]
    bos_token_id: int
    pad_token_id: int

    @classmethod
    def from_engine(cls, info: EngineInfo, served_model_name: str | None,
                    model: str | None) -> ModelFacts:
        cfg = _hf_config(info.folder)
        return cls(
            served_model_name=served_model_name or info.model_name,
            model_path=str(model) if model else info.folder,
            tokenizer_path=info.folder, max_context_length=info.max_model_len,
            vocab_size=info.vocab_size, model_type=str(cfg.get("model_type", "")),
            architectures=[str(a) for a in cfg.get("architectures", [])],
            eos_token_ids=list(info.eos_token_ids),
            bos_token_id=_first_id(cfg.get("bos_token_id")),
            pad_token_id=_first_id(cfg.get("pad_token_id")))

    def model_info(self) -> dict[str, Any]:
        """``GET /model_info`` (SGLang's field names)."""
        return {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path,
                "is_generation": True, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": self.model_type,
                "architectures": self.architectures,
                "served_model_name": self.served_model_name,
                "max_context_length": self.max_context_length,
                "vocab_size": self.vocab_size, "eos_token_ids": self.eos_token_ids}


def server_info(facts: ModelFacts, config: EngineConfig, info: EngineInfo,
                started_at: float) -> dict[str, Any]:
    """``GET /server_info`` (the SGLang field names smg reads, plus the engine's settings).

    Args:
        facts: the model's facts.
        config: the engine configuration.
        info: the engine's facts (pool size).
        started_at: ``time.time()`` when the server started, seconds.
    """
    usable_pages = max(0, info.num_pages - 1)  # page 0 is the null page
    return {
        "model_id": facts.served_model_name, "model_path": facts.model_path,
        "served_model_name": facts.served_model_name, "tp_size": 1, "dp_size": 1, "pp_size": 1,
        "disaggregation_mode": "null", "version": radixserve.__version__,
        "engine": ENGINE_NAME, "is_embedding": False,
        "context_length": facts.max_context_length,
        "max_total_tokens": usable_pages * info.page_size,
        "max_running_requests": config.max_num_seqs,
        "page_size": info.page_size, "num_pages": info.num_pages,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_prefix_caching": config.enable_prefix_caching,
        "schedule_policy": config.schedule_policy, "dtype": info.dtype,
        "device": info.device, "uptime_seconds": time.time() - started_at,
        # vLLM's names; the batch-size cap as applied (its "auto" resolved for the device)
        "speculative_config": (None if info.speculative is None
                               else msgspec.structs.asdict(info.speculative)),
    }


@dataclass
class LoadReporter:
    """Turns the engine's latest ``SchedulerStats`` into load reports (``GET /v1/loads``,
    gRPC ``GetLoads``), with the generation rate measured between two reports."""

    _last: tuple[float, int] | None = field(default=None, repr=False)
    _rate: float = field(default=0.0, repr=False)

    def load(self, stats: SchedulerStats | None, info: EngineInfo,
             max_running_requests: int, busy_s: float = 0.0) -> dict[str, Any]:
        """One ``SchedulerLoad`` as a dict (counts 0 before the engine's first step).

        Args:
            stats: the engine's latest snapshot (None before its first step).
            info: the engine's facts (pool size, page size).
            max_running_requests: ``max_num_seqs``.
            busy_s: seconds so far the engine had running requests
                (``AsyncEngineClient.busy_s``).

        ``token_usage`` is the fraction of KV pages live requests own outside the radix cache
        (0..1; cached pages, evictable or shared, do not count: eviction or sharing makes room
        for them, as vLLM counts its cached free blocks as free), ``num_used_tokens`` the pages
        not free (radix cache included) in tokens, ``cache_hit_rate`` the fraction of
        looked-up prompt tokens found in the radix cache since start, ``gen_throughput``
        output tokens per second of busy time (time with running requests) since the previous
        report that saw some, so an idle engine is not reported as a slow one (0 until
        measured: smg then assumes its default). smg's ``least_load`` and cache-aware
        fallback divide queued work by it.
        ``num_waiting_uncached_tokens`` is left out: the engine does not know it (smg reads a
        missing value as 0).
        """
        s = stats or SchedulerStats()
        if self._last is None:
            self._last = (busy_s, s.generation_tokens)
        elif busy_s - self._last[0] >= 0.05:  # enough busy time for a rate
            self._rate = max(0, s.generation_tokens - self._last[1]) / (busy_s - self._last[0])
            self._last = (busy_s, s.generation_tokens)
        total_pages = info.num_pages - 1  # page 0 is the null page
        owned = max(0, s.kv_pages_used - s.kv_pages_cached)
        usage = owned / total_pages if total_pages > 0 else 0.0
        return {
            "dp_rank": 0, "num_running_reqs": s.num_running, "num_waiting_reqs": s.num_waiting,
            "num_total_reqs": s.num_running + s.num_waiting,
            "num_used_tokens": s.kv_pages_used * info.page_size,
            "max_total_num_tokens": total_pages * info.page_size, "token_usage": usage,
            "utilization": usage,
            "gen_throughput": self._rate,
            "cache_hit_rate": (s.prefix_hit_tokens / s.prefix_queried_tokens
                               if s.prefix_queried_tokens else 0.0),
            "max_running_requests": max_running_requests,
        }

    def loads_response(self, stats: SchedulerStats | None, info: EngineInfo,
                       max_running_requests: int, busy_s: float = 0.0) -> dict[str, Any]:
        """``GET /v1/loads`` body: ``{"timestamp", "version", "dp_rank_count", "loads"}``."""
        return {"timestamp": datetime.now(timezone.utc).isoformat(),
                "version": radixserve.__version__, "dp_rank_count": 1,
                "loads": [self.load(stats, info, max_running_requests, busy_s)]}
