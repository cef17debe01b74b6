"""What every handler shares once the engine and tokenizer are ready: ``ServingState``."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.engine_types import EngineInfo
from radixserve.entrypoints.openai.errors import OpenAIError
from radixserve.frontend.async_client import AsyncEngineClient
from radixserve.frontend.tokenizer import FrontendTokenizer
from radixserve.metrics import ServerMetrics


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
    """

    client: AsyncEngineClient
    tokenizer: FrontendTokenizer
    info: EngineInfo
    served_model_name: str
    model_aliases: frozenset[str]
    metrics: ServerMetrics
    max_concurrent_requests: int | None = None
    active_requests: int = 0

    def check_model(self, model: str | None) -> None:
        """Raises OpenAIError 404 for a model name this server does not serve (None is fine)."""
        if model is None or model == self.served_model_name or model in self.model_aliases:
            return
        raise OpenAIError(f"The model `{model}` does not exist. This server serves "
                          f"`{self.served_model_name}`.", 404, param="model",
                          code="model_not_found")
