"""What every handler shares once the engine and tokenizer are ready: ``ServingState``."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from radixserve.engine_types import EngineInfo
from radixserve.entrypoints.openai.errors import OpenAIError
from radixserve.entrypoints.request_log import RequestLogger
from radixserve.frontend.async_client import AsyncEngineClient
from radixserve.frontend.tokenizer import FrontendTokenizer
from radixserve.metrics import ServerMetrics
from radixserve.sampling_params import StructuredOutputsParams
from radixserve.structured.compiler import GrammarCompiler, GrammarError


@dataclass
class ServingState:
    """Everything a handler needs once the engine is ready.

    Attributes:
        client: the engine client.
        tokenizer: the frontend tokenizer.
        info: the engine's facts (max_model_len, vocab size, ...).
        served_model_name: the name clients use; ``model_aliases`` are also accepted.
        metrics: Prometheus metrics.
        max_concurrent_requests: generation requests in flight at most (None: no limit).
        active_requests: generation requests in flight now (see ``ConcurrencySlot``).
        grammar_compiler: the xgrammar compiler over this tokenizer, made at the first
            constrained request (``check_constraint``).
        sampling_defaults: the model's sampling defaults (``--generation-config``) for the
            fields a request leaves unset; empty: the server's own.
        request_log: the per-request log lines.
        running_ids: ids of the API requests in flight (a client's id must be unique among
            them: ``X-Request-Id`` / ``request_id``).
        served_model_names: every ``--served-model-name`` (the first is
            ``served_model_name``, the one responses carry); each is listed by /v1/models.
        tool_call_parser: ``--tool-call-parser`` (None: Hermes, radixserve's default).
        enable_auto_tool_choice: ``--enable-auto-tool-choice``.
    """

    client: AsyncEngineClient
    tokenizer: FrontendTokenizer
    info: EngineInfo
    served_model_name: str
    model_aliases: frozenset[str]
    metrics: ServerMetrics
    max_concurrent_requests: int | None = None
    active_requests: int = 0
    grammar_compiler: GrammarCompiler | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    request_log: RequestLogger = field(default_factory=RequestLogger)
    running_ids: set[str] = field(default_factory=set)
    served_model_names: tuple[str, ...] = ()
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    _compiler_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _compiler(self) -> GrammarCompiler:
        with self._compiler_lock:
            if self.grammar_compiler is None:
                self.grammar_compiler = GrammarCompiler(
                    self.tokenizer.hf, self.info.vocab_size, list(self.info.eos_token_ids))
            return self.grammar_compiler

    async def check_constraint(self, spec: StructuredOutputsParams | None, param: str) -> None:
        """Compile ``spec`` here, before it is submitted, so a bad schema, regex or grammar is
        a 400 naming ``param`` and the engine core never sees it (compiled grammars are
        cached; compiling runs in a worker thread, off the event loop).

        Raises:
            OpenAIError: 400 with xgrammar's reason.
        """
        if spec is None:
            return

        def compile_() -> None:
            self._compiler().compile(spec)

        try:
            await asyncio.to_thread(compile_)
        except GrammarError as e:
            raise OpenAIError(f"{param}: {e}", param=param) from None

    def check_model(self, model: str | None) -> None:
        """Raises OpenAIError 404 for a model name this server does not serve (None is fine)."""
        if (model is None or model == self.served_model_name or model in self.model_aliases
                or model in self.served_model_names):
            return
        raise OpenAIError(f"The model `{model}` does not exist. This server serves "
                          f"`{self.served_model_name}`.", 404, param="model",
                          code="model_not_found")
