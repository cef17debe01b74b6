"""The OpenAI-compatible HTTP app: ``build_app(server_config, client)``.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``
(OpenAI's Responses API, served by the chat path), ``GET /v1/models``,
``GET /v1/models/{id}`` (the served name or an alias; 404 ``model_not_found`` otherwise),
``GET /health`` (200 once the model is loaded; 503 "loading" before, "draining" after SIGTERM,
"dead" after the engine died),
``GET /metrics`` (Prometheus), ``POST /tokenize``, ``POST /detokenize``, ``GET /version``, and
the gateway-facing ``GET /server_info``, ``GET /model_info``, ``GET /v1/loads``,
``POST /flush_cache`` (``worker_info.py``), and the chat page at ``GET /`` (``chat_page.py``).

The app starts the engine client in the background when it starts (so /health can answer 503
while the model loads), loads the tokenizer named by the engine's Hello, and only then serves
generation requests. Middlewares: API-key auth on ``/v1/*`` (when configured), the body-size
limit (413), and CORS with ``--allowed-origins``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

import radixserve
from radixserve.config import ServerConfig
from radixserve.entrypoints.engine_start import start_engine_with_tokenizer
from radixserve.entrypoints.openai.chat_page import register_chat_page
from radixserve.entrypoints.openai.errors import OpenAIError, add_exception_handlers
from radixserve.entrypoints.openai.middleware import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    RequestIdMiddleware,
)
from radixserve.entrypoints.openai.protocol import (
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from radixserve.entrypoints.openai.serving_chat import create_chat_completion
from radixserve.entrypoints.openai.serving_completion import create_completion
from radixserve.entrypoints.openai.serving_driver import ClientDisconnected
from radixserve.entrypoints.openai.serving_request import check_token_ids, parse_body
from radixserve.entrypoints.openai.serving_responses import create_response
from radixserve.entrypoints.openai.serving_state import ServingState
from radixserve.entrypoints.openai.worker_info import register_worker_routes
from radixserve.entrypoints.request_log import RequestLogger, StatsLogger
from radixserve.frontend.async_client import AsyncEngineClient
from radixserve.frontend.generation_config import log_sampling_defaults, sampling_defaults
from radixserve.frontend.tokenizer import FrontendTokenizer
from radixserve.metrics import ServerMetrics

log = logging.getLogger("radixserve.server")

#: ``Retry-After`` seconds of a draining server's 503s: soon, since a client behind a load
#: balancer lands on another instance.
RETRY_AFTER_S = 1
#: Seconds between checks of the running requests while draining.
DRAIN_POLL_S = 0.05


class AppState:
    """The app's mutable state: ``serving`` is None until the engine and tokenizer are ready."""

    def __init__(self, config: ServerConfig, client: AsyncEngineClient) -> None:
        self.config = config
        self.client = client
        self.serving: ServingState | None = None
        self.metrics = ServerMetrics(model_name=config.served_model_name or "")
        self.start_task: asyncio.Task | None = None
        self.stats_task: asyncio.Task | None = None
        self.start_error: str | None = None

    def ready(self) -> ServingState:
        """The serving state.

        Raises:
            OpenAIError: 503 while loading, draining (with ``Retry-After``) or after the
                engine died.
        """
        s = self.serving
        if s is None or not self.client.healthy:
            headers = ({"Retry-After": str(RETRY_AFTER_S)} if self.client.draining
                       else None)
            raise OpenAIError(f"Service unavailable: {self.unavailable_reason()}", 503,
                              headers=headers)
        return s

    def unavailable_reason(self) -> str:
        c = self.client
        if c.dead_reason or self.start_error:
            return c.dead_reason or self.start_error or ""
        if c.draining or not c.ready and self.serving is not None:
            return ("the server is draining: it finishes its running requests and stops; "
                    "retry on another instance")
        return "the model is still loading"

    @property
    def in_flight(self) -> int:
        """API generation requests running (streams count until their last byte)."""
        return 0 if self.serving is None else self.serving.active_requests

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting (503 with ``Retry-After``; /health 503 "draining"), let the running
        requests finish for up to ``timeout_s`` seconds, then fail the rest (their response,
        or their stream's last event, says the server shut down before they finished)."""
        self.client.begin_drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        log.info("draining: %d requests running, waiting up to %.0f s for them",
                 self.in_flight, timeout_s)
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = self.in_flight
        if left:
            log.warning("shutdown timeout (%.0f s) passed: aborting %d running requests",
                        timeout_s, left)
        else:
            log.info("drained: no request running")
        self.client.begin_shutdown(
            f"the server shut down before the request finished (--shutdown-timeout "
            f"{timeout_s:g} s)")

    async def start(self) -> None:
        """Start the engine, load the tokenizer, build the serving state. On failure the
        client's ``on_fatal`` is called (the server exits non-zero)."""
        client = self.client
        try:
            info, hf_tok = await start_engine_with_tokenizer(client)
            if self.config.chat_template is not None:
                # --chat-template: every chat request and /tokenize renders with it
                hf_tok.chat_template = self.config.chat_template
            client.set_tokenizer(hf_tok)
            name = self.config.served_model_name or info.model_name
            aliases = {info.model_name, info.folder}
            if client.config.model:
                aliases.add(str(client.config.model))
            metrics = ServerMetrics(model_name=name)
            gen = client.config.generation_config
            defaults = sampling_defaults(gen, info.folder)
            log_sampling_defaults(defaults, gen)
            cfg = self.config
            self.serving = ServingState(
                client=client, tokenizer=FrontendTokenizer(hf_tok), info=info,
                served_model_name=name, model_aliases=frozenset(aliases), metrics=metrics,
                max_concurrent_requests=cfg.max_concurrent_requests,
                sampling_defaults=defaults,
                request_log=RequestLogger(cfg.log_requests, cfg.log_prompts),
                served_model_names=(name, *cfg.extra_model_names),
                tool_call_parser=cfg.tool_call_parser,
                enable_auto_tool_choice=cfg.enable_auto_tool_choice)
            self.metrics = metrics
            if cfg.log_stats:
                self.stats_task = asyncio.ensure_future(
                    StatsLogger(cfg.log_stats_interval_s).run(lambda: client.stats))
            log.info("ready: serving %s (max_model_len %d) on %s://%s:%d", name,
                     info.max_model_len, "https" if cfg.ssl_certfile else "http",
                     self.config.host, self.config.port)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any start failure ends the server
            self.start_error = f"{type(e).__name__}: {e}"
            log.error("server failed to start: %s", self.start_error)
            if client.on_fatal is not None:
                client.on_fatal(self.start_error)


def build_app(server_config: ServerConfig, client: AsyncEngineClient) -> FastAPI:
    """The FastAPI app serving ``client``'s engine under ``server_config``.

    The engine starts when the app's lifespan starts and is shut down when it ends.
    """
    state = AppState(server_config, client)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.start_task = asyncio.ensure_future(state.start())
        try:
            yield
        finally:
            for task in (state.start_task, state.stats_task):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
            await client.shutdown(server_config.graceful_timeout_s)

    app = FastAPI(title="radixserve", version=radixserve.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.radixserve = state
    add_exception_handlers(app)

    async def on_disconnect(_: Request, __: Exception) -> Response:
        return Response(status_code=499)

    app.add_exception_handler(ClientDisconnected, on_disconnect)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=server_config.max_request_bytes)
    if server_config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server_config.api_key)
    app.add_middleware(RequestIdMiddleware)  # every answer carries the id
    if server_config.allowed_origins is not None:
        # outermost: a browser's preflight (OPTIONS, no API key) is answered here, and every
        # answer, a 401 included, carries the CORS headers the browser needs to read it
        app.add_middleware(CORSMiddleware, allow_origins=list(server_config.allowed_origins),
                           allow_credentials=server_config.allow_credentials,
                           allow_methods=list(server_config.allowed_methods),
                           allow_headers=list(server_config.allowed_headers),
                           expose_headers=["X-Request-Id"])

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Any:
        return await create_chat_completion(raw, state.ready())

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Any:
        return await create_completion(raw, state.ready())

    @app.post("/v1/responses")
    async def responses(raw: Request) -> Any:
        return await create_response(raw, state.ready())

    def model_card(s: ServingState, name: str | None = None) -> ModelCard:
        return ModelCard(id=name or s.served_model_name, root=s.info.folder,
                         max_model_len=s.info.max_model_len)

    @app.get("/v1/models")
    async def models() -> Any:
        s = state.ready()
        names = s.served_model_names or (s.served_model_name,)
        return JSONResponse(ModelList(data=[model_card(s, n) for n in names]).model_dump())

    # ``:path``: an alias may be a folder or a Hugging Face repo id, slashes included
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        s = state.ready()
        s.check_model(model_id)  # 404 model_not_found for a name this server does not serve
        name = model_id if model_id in s.served_model_names else None
        return JSONResponse(model_card(s, name).model_dump())

    @app.get("/health")
    async def health() -> Response:
        if state.serving is not None and client.healthy:
            return JSONResponse({"status": "ok"})
        reason = state.unavailable_reason()
        status = ("dead" if client.dead_reason or state.start_error else
                  "loading" if reason == "the model is still loading" else "draining")
        return JSONResponse({"status": status, "reason": reason}, status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_S)}
                            if status == "draining" else None)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": radixserve.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        m = state.metrics
        if client.stats is not None:
            m.update_from_stats(msgspec.structs.replace(
                client.stats, step_timings=client.drain_step_timings()))
        body, content_type = m.render()
        return Response(body, media_type=content_type)

    register_worker_routes(app, state)  # /server_info, /model_info, /v1/loads, /flush_cache
    register_chat_page(app)  # / (open, like /health: its /v1 calls carry the key)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        req = await parse_body(raw, TokenizeRequest)
        s = state.ready()
        s.check_model(req.model)
        tok = s.tokenizer
        if req.messages is not None:
            try:
                text = tok.chat_prompt([{"role": m.role, "content": m.text()}
                                        for m in req.messages], req.add_generation_prompt)
            except ValueError as e:
                raise OpenAIError(str(e), param="messages") from None
            ids = await tok.encode_async(text)
        else:
            assert req.prompt is not None
            if req.add_special_tokens:
                ids = list(tok.hf.encode(req.prompt, add_special_tokens=True))
            else:
                ids = await tok.encode_async(req.prompt)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": s.info.max_model_len,
                                "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = tok.hf.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        req = await parse_body(raw, DetokenizeRequest)
        s = state.ready()
        s.check_model(req.model)
        if req.tokens:
            check_token_ids(req.tokens, s.info.vocab_size, "tokens")
        return JSONResponse({"prompt": s.tokenizer.decode(req.tokens)})

    return app
