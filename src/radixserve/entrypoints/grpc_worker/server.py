"""``radixserve serve --grpc``: the ``VllmEngine`` gRPC service (grpcio asyncio) over the
engine-core process, plus Prometheus ``/metrics`` and ``/health`` on a side HTTP port
(``--metrics-port``), since a gateway and a scraper both need them and gRPC has no ``/metrics``.

Start-up: the side HTTP port binds first (``/health`` answers 503 "loading"), then the engine
core loads the model, the tokenizer is loaded (for ``text`` prompts and worker-side stop
strings), and only then the gRPC port binds: a gateway never sees a half-ready worker.
Shutdown on SIGTERM/SIGINT drains: the standard gRPC health service and ``HealthCheck`` turn
unhealthy and new ``Generate`` calls get UNAVAILABLE (the gateway routes elsewhere), while the
running ones finish for up to ``--shutdown-timeout`` seconds; then what still runs ends with
UNAVAILABLE, the server stops (``graceful_timeout_s``) and the engine core exits. A second
signal stops at once. Exit status: 0 after a signal, 1 when the engine died or could not start
or a port could not be bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Generator
from typing import Any

import grpc
import msgspec
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from radixserve.config import EngineConfig, ServerConfig
from radixserve.entrypoints.engine_start import start_engine_with_tokenizer
from radixserve.entrypoints.grpc_worker.constraints import ConstraintChecker
from radixserve.entrypoints.grpc_worker.servicer import VllmEngineServicer, WorkerState
from radixserve.entrypoints.request_log import RequestLogger, StatsLogger
from radixserve.entrypoints.worker_facts import ModelFacts
from radixserve.frontend.async_client import AsyncEngineClient
from radixserve.frontend.generation_config import log_sampling_defaults, sampling_defaults
from radixserve.frontend.tokenizer import FrontendTokenizer
from radixserve.logs import LOG_FORMAT_ENV
from radixserve.metrics import ServerMetrics

log = logging.getLogger("radixserve.grpc")

#: Largest gRPC message sent (responses are small; tokenizer chunks are 64 KiB). Received
#: messages are bounded by ``--max-request-bytes``.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: The gRPC service name ``VllmEngine`` registers under (for the standard health service).
SERVICE_NAME = "vllm.grpc.engine.VllmEngine"
#: Seconds between checks of the running requests while draining.
DRAIN_POLL_S = 0.05


def grpc_address(host: str, port: int) -> str:
    """``host:port`` for grpcio, IPv6 literals bracketed."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def run_grpc_worker(server_config: ServerConfig, engine_config: EngineConfig,
                    metrics_port: int | None = None, log_level: str = "info") -> int:
    """Serve until SIGTERM/SIGINT (returns 0) or the engine's death / a failed start (1)."""
    return asyncio.run(_serve(server_config, engine_config, metrics_port, log_level))


class _SideServer:
    """``/metrics`` and ``/health`` on an HTTP port of their own (uvicorn, same event loop)."""

    def __init__(self, host: str, port: int, client: AsyncEngineClient, log_level: str) -> None:
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, Response

        self.metrics: ServerMetrics | None = None
        self.ready = False
        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/health")
        async def health_route() -> Response:
            if self.ready and client.healthy:
                return JSONResponse({"status": "ok"})
            status = "dead" if client.dead_reason else "loading" if not self.ready else (
                "draining")
            return JSONResponse({"status": status}, status_code=503)

        @app.get("/metrics")
        async def metrics_route() -> Response:
            m = self.metrics
            if m is None:
                return Response("", media_type="text/plain")
            if client.stats is not None:
                m.update_from_stats(msgspec.structs.replace(
                    client.stats, step_timings=client.drain_step_timings()))
            body, content_type = m.render()
            return Response(body, media_type=content_type)

        # with --log-format json, uvicorn's loggers go through the root handler too
        json_logs = os.environ.get(LOG_FORMAT_ENV) == "json"
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                access_log=False, lifespan="off",
                                **({"log_config": None} if json_logs else {}))

        class _NoSignals(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                yield  # the worker handles SIGTERM/SIGINT itself

        self.server = _NoSignals(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> bool:
        """Bind and serve in the background; False when the port could not be bound."""
        self.task = asyncio.ensure_future(self.server.serve())
        while not self.server.started:
            if self.task.done():
                return False
            await asyncio.sleep(0.01)
        return True

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.task, 5)


async def _serve(server_config: ServerConfig, engine_config: EngineConfig,
                 metrics_port: int | None, log_level: str) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        stop.set()

    drain = asyncio.Event()
    serving: list[bool] = []  # set once the gRPC port serves

    def on_signal(sig: int) -> None:
        name = signal.Signals(sig).name
        if serving and not drain.is_set() and not stop.is_set():
            log.info("received %s: draining (up to %g s; a second signal stops at once)",
                     name, server_config.shutdown_timeout_s)
            drain.set()
            return
        log.info("received %s: shutting down", name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    client = AsyncEngineClient(engine_config, null_model=server_config.null_model,
                               null_step_ms=server_config.null_step_ms, on_fatal=on_fatal)
    side: _SideServer | None = None
    server: grpc.aio.Server | None = None
    health_servicer = health.aio.HealthServicer()
    try:
        if metrics_port is not None:
            side = _SideServer(server_config.host, metrics_port, client, log_level)
            if not await side.start():
                log.error("cannot bind the metrics port %s:%d", server_config.host, metrics_port)
                return 1
        state = await _start_engine(client, server_config, stop)
        if state is None:
            return 1 if fatal or not stop.is_set() else 0
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", server_config.max_request_bytes),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # without this a second server could bind the same port and share its traffic
            ("grpc.so_reuseport", 0)])
        servicer = VllmEngineServicer(state, server_config.max_concurrent_requests)
        pb_grpc.add_VllmEngineServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        addr = grpc_address(server_config.host, server_config.port)
        try:
            port = server.add_insecure_port(addr)
        except RuntimeError as e:
            port = 0
            log.error("cannot bind %s: %s", addr, e)
        if port == 0:
            log.error("cannot bind the gRPC port %s", addr)
            return 1
        await server.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        if side is not None:
            side.metrics = state.metrics
            side.ready = True
        log.info("ready: serving %s (max_model_len %d) over gRPC on %s",
                 state.facts.served_model_name, state.info.max_model_len,
                 grpc_address(server_config.host, port))
        serving.append(True)
        stats_task = (asyncio.ensure_future(StatsLogger(server_config.log_stats_interval_s)
                                            .run(lambda: client.stats))
                      if server_config.log_stats else None)
        try:
            await _first(stop, drain)
            if drain.is_set() and not stop.is_set():
                await health_servicer.enter_graceful_shutdown()
                client.begin_drain()
                await _drain(servicer, stop, server_config.shutdown_timeout_s)
        finally:
            if stats_task is not None:
                stats_task.cancel()
        return 1 if fatal else 0
    finally:
        await health_servicer.enter_graceful_shutdown()
        client.begin_shutdown("server is shutting down")  # in-flight streams end now
        if server is not None:
            await server.stop(server_config.graceful_timeout_s)
        await client.shutdown(server_config.graceful_timeout_s)
        if side is not None:
            await side.stop()
        if fatal:
            log.error("exiting: %s", fatal[0])


async def _first(*events: asyncio.Event) -> None:
    """Return when any of ``events`` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def _drain(servicer: VllmEngineServicer, stop: asyncio.Event, timeout_s: float) -> None:
    """Wait until no ``Generate`` call runs, ``timeout_s`` seconds pass, or ``stop`` is set (a
    second signal, the engine's death); the caller then fails what still runs."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    log.info("draining: %d requests running, waiting up to %g s for them",
             len(servicer.active), timeout_s)
    while servicer.active and loop.time() < deadline and not stop.is_set():
        await asyncio.sleep(DRAIN_POLL_S)
    if servicer.active:
        log.warning("aborting %d running requests (shutdown timeout %g s passed or a second "
                    "signal came)", len(servicer.active), timeout_s)
    else:
        log.info("drained: no request running")


async def _start_engine(client: AsyncEngineClient, server_config: ServerConfig,
                        stop: asyncio.Event) -> WorkerState | None:
    """Start the engine core and load the tokenizer; None when a signal or the engine's
    death came first (or the start failed: logged)."""

    async def start() -> WorkerState:
        info, hf_tok = await start_engine_with_tokenizer(client)
        client.set_tokenizer(hf_tok)
        facts = ModelFacts.from_engine(info, server_config.served_model_name,
                                       client.config.model)
        gen = client.config.generation_config
        defaults = sampling_defaults(gen, info.folder)
        log_sampling_defaults(defaults, gen)
        return WorkerState(client=client, tokenizer=FrontendTokenizer(hf_tok), info=info,
                           facts=facts, metrics=ServerMetrics(model_name=facts.served_model_name),
                           constraints=ConstraintChecker(hf_tok, info.vocab_size,
                                                         list(info.eos_token_ids)),
                           sampling_defaults=defaults,
                           request_log=RequestLogger(server_config.log_requests,
                                                     server_config.log_prompts))

    task: asyncio.Task[Any] = asyncio.ensure_future(start())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return None
    try:
        return task.result()
    except Exception as e:  # noqa: BLE001 - any start failure ends the worker
        log.error("worker failed to start: %s: %s", type(e).__name__, e)
        return None
