"""The endpoints a gateway (smg) calls on an HTTP worker, beside the OpenAI API:
``GET /server_info``, ``GET /model_info``, ``GET /v1/loads`` and ``POST /flush_cache``.

smg probes ``/v1/models`` (``owned_by``), then ``/version`` and ``/server_info`` to classify a
worker, reads ``/server_info`` and ``/model_info`` for its labels, polls
``/v1/loads?include=...`` for load-aware policies and fans ``POST /flush_cache`` out to every
worker. Field names are the ones it parses (see ``entrypoints/worker_facts.py``).
"""

from __future__ import annotations

import hmac
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from radixserve.entrypoints.openai.errors import OpenAIError
from radixserve.entrypoints.worker_facts import LoadReporter, ModelFacts, server_info
from radixserve.frontend.async_client import EngineDeadError


def register_worker_routes(app: FastAPI, state: Any) -> None:
    """Add the gateway-facing routes to ``app``.

    Args:
        app: the OpenAI server's app.
        state: its ``server.AppState`` (``ready()`` raises a 503 ``OpenAIError`` while the
            model loads; ``config`` is the ``ServerConfig``; ``client`` the engine client).
    """
    started_at = time.time()
    reporter = LoadReporter()

    def facts() -> ModelFacts:
        s = state.ready()
        return ModelFacts.from_engine(s.info, s.served_model_name, state.client.config.model)

    @app.get("/model_info")
    async def model_info() -> JSONResponse:
        return JSONResponse(facts().model_info())

    @app.get("/server_info")
    async def get_server_info() -> JSONResponse:
        f = facts()
        return JSONResponse(server_info(f, state.client.config, state.ready().info, started_at))

    @app.get("/v1/loads")
    async def loads() -> JSONResponse:
        # ``include`` (core, disagg, queues, memory) is accepted and answered with the core
        # section: this engine has no disaggregation, queue or memory sections to report
        s = state.ready()
        c = state.client
        return JSONResponse(reporter.loads_response(c.stats, s.info, c.config.max_num_seqs,
                                                    c.busy_s))

    @app.post("/flush_cache")
    async def flush_cache(raw: Request) -> JSONResponse:
        # an admin action: it needs the API key when one is set, as /v1/* does
        key = state.config.api_key
        if key and not hmac.compare_digest(raw.headers.get("authorization", "").encode(),
                                           f"Bearer {key}".encode()):
            raise OpenAIError("Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                              401, code="invalid_api_key")
        state.ready()
        try:
            freed = await state.client.flush_cache()
        except EngineDeadError as e:
            raise OpenAIError(f"Service unavailable: {e}", 503) from None
        return JSONResponse({"success": True, "pages_freed": freed,
                             "message": f"flushed the radix cache: {freed} KV pages freed"})
