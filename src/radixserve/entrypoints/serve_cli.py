"""``radixserve serve [MODEL]``: the OpenAI-compatible server (frontend + engine-core process),
or with ``--grpc`` a gRPC engine worker for smg (``entrypoints/grpc_worker``), or with
``--zmq-worker URL`` a headless engine core that smg drives directly over vLLM's EngineCore
ZMQ wire (``core.engine_proc.run_vllm_engine_process``).

SIGTERM/SIGINT drains: new requests get 503 with ``Retry-After`` and /health answers 503
"draining", while running requests (streams included) finish for up to ``--shutdown-timeout``
seconds; what still runs then is aborted. A second signal stops at once.

Exit status: 0 after SIGTERM/SIGINT (engine stopped, IPC files removed); 1 when the engine
core died or failed to start; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Generator
from pathlib import Path

from radixserve.config import (
    DEFAULT_MAX_REQUEST_BYTES,
    TOOL_CALL_PARSERS,
    EngineConfig,
    ServerConfig,
)
from radixserve.logs import configure_logging

log = logging.getLogger("radixserve.serve")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand to the ``radixserve`` parser."""
    from radixserve.entrypoints.engine_args import add_engine_args, parse_bytes

    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder or GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* "
                        "(default: env RADIXSERVE_API_KEY)")
    p.add_argument("--max-request-bytes", type=parse_bytes, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get 413 (default 8MiB)")
    p.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="generation requests in flight at most; more get 429 (default: no limit)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   action=_ServedNames,
                   help="model name(s) clients use; responses carry the first, requests may "
                        "name any (default: the model's own name)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template replacing the model's: a file, or the template "
                        "itself")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice 'auto' read by --tool-call-parser (needs it)")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="the model family's tool-call format (vLLM's names; default: Hermes "
                        "where the template writes it or ignores tools)")
    p.add_argument("--allowed-origins", type=_str_list, default=None, metavar="ORIGINS",
                   help="CORS: origins allowed, a JSON list or comma-separated ('*': any; "
                        "default: no CORS headers)")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (with --allowed-origins)")
    p.add_argument("--allowed-methods", type=_str_list, default=["*"], metavar="METHODS",
                   help="CORS: methods allowed (default '*')")
    p.add_argument("--allowed-headers", type=_str_list, default=["*"], metavar="HEADERS",
                   help="CORS: request headers allowed (default '*')")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    p.add_argument("--ssl-certfile", default=None,
                   help="serve HTTPS with this certificate (chain)")
    p.add_argument("--ssl-ca-certs", default=None,
                   help="with HTTPS: CA certificates that verify client certificates")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="log lines as text or as one JSON object each (default text)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per finished request")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic throughput/occupancy line")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between stats lines (default 10)")
    p.add_argument("--log-prompts", action="store_true",
                   help="include the prompt text in request log lines (never logged "
                        "otherwise)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="after SIGTERM, seconds running requests may take to finish while new "
                        "ones get 503; then they are aborted (default 30)")
    p.add_argument("--grpc", action="store_true",
                   help="serve smg's vllm.grpc.engine.VllmEngine gRPC service on --port "
                        "instead of HTTP (a worker behind `smg launch --worker-urls "
                        "grpc://HOST:PORT`; needs the grpc extra)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="with --grpc: serve Prometheus /metrics and /health over HTTP on this "
                        "port (default: none)")
    p.add_argument("--zmq-worker", metavar="URL", default=None,
                   help="run headless: the engine core alone, driven by smg over vLLM's "
                        "EngineCore ZMQ wire (`smg launch --backend vllm --worker-urls URL "
                        "--model-path MODEL_DIR`); URL is the same ipc://PATH, or smg's "
                        "handshake address tcp://HOST:PORT. No HTTP, no gRPC: smg tokenizes, "
                        "detokenizes and serves the OpenAI API")
    p.add_argument("--null-model", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--null-step-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    add_engine_args(p, skip=("model",))
    p.set_defaults(func=cmd_serve)


class _ServedNames(argparse.Action):
    """``--served-model-name A [B ...]``: ``served_model_name`` is the first (the name
    responses carry), ``served_model_names`` all of them (vLLM's flag)."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        names = list(values) if isinstance(values, list) else [str(values)]
        ns.served_model_names = names
        setattr(ns, self.dest, names[0])


def _str_list(text: str) -> list[str]:
    """A JSON list of strings (vLLM's form, ``'["https://a.example"]'``) or a
    comma-separated list."""
    import json

    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return items
    return [x.strip() for x in text.split(",") if x.strip()]


def load_chat_template(value: str) -> str:
    """``--chat-template``'s template: the file's text, or the value itself when it holds
    template syntax (vLLM reads it the same way).

    Raises:
        ValueError: a value that looks like a path but names no readable file.
    """
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {value}: {e}") from None
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template: {value!r} is not a file, nor a template (no "
                     "braces or newlines in it)")


#: Flags of the HTTP server that a --grpc or --zmq-worker process has no use for.
_HTTP_ONLY = ("chat_template", "enable_auto_tool_choice", "tool_call_parser",
              "allowed_origins", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs")


def cmd_serve(ns: argparse.Namespace) -> int:
    from radixserve.entrypoints.engine_args import engine_config_from_args

    try:
        engine_config = engine_config_from_args(ns)
        engine_config.model = ns.model
        names = getattr(ns, "served_model_names", None) or []
        server_config = ServerConfig(
            host=ns.host, port=ns.port, api_key=ns.api_key or None,
            max_request_bytes=ns.max_request_bytes,
            max_concurrent_requests=ns.max_concurrent_requests,
            served_model_name=ns.served_model_name, null_model=ns.null_model,
            null_step_ms=ns.null_step_ms, shutdown_timeout_s=ns.shutdown_timeout,
            log_requests=not ns.disable_log_requests, log_stats=not ns.disable_log_stats,
            log_stats_interval_s=ns.log_stats_interval, log_format=ns.log_format,
            log_prompts=ns.log_prompts, extra_model_names=tuple(names[1:]),
            chat_template=(None if ns.chat_template is None
                           else load_chat_template(ns.chat_template)),
            tool_call_parser=ns.tool_call_parser,
            enable_auto_tool_choice=ns.enable_auto_tool_choice,
            allowed_origins=(None if ns.allowed_origins is None
                             else tuple(ns.allowed_origins)),
            allow_credentials=ns.allow_credentials,
            allowed_methods=tuple(ns.allowed_methods),
            allowed_headers=tuple(ns.allowed_headers),
            ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile,
            ssl_ca_certs=ns.ssl_ca_certs)
    except ValueError as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2
    if ns.grpc or ns.zmq_worker is not None:
        http_only = [f"--{k.replace('_', '-')}" for k in _HTTP_ONLY
                     if getattr(ns, k) not in (None, False)]
        if http_only:
            print(f"radixserve: error: {', '.join(http_only)} are options of the HTTP "
                  "server; a --grpc or --zmq-worker process serves no OpenAI API (the "
                  "gateway in front does)", file=sys.stderr)
            return 2
    if ns.zmq_worker is not None and (ns.grpc or ns.metrics_port is not None
                                      or server_config.api_key):
        print("radixserve: error: --zmq-worker runs the engine core alone: --grpc, "
              "--metrics-port and --api-key do not apply (smg serves the API)", file=sys.stderr)
        return 2
    if ns.metrics_port is not None and not ns.grpc:
        print("radixserve: error: --metrics-port needs --grpc (the HTTP server serves /metrics)",
              file=sys.stderr)
        return 2
    if ns.grpc and server_config.api_key:
        # the gateway in front authenticates clients; the worker's port is for it alone
        print("radixserve: error: --api-key is an HTTP option; a --grpc worker has no "
              "authentication (bind it to a private address)", file=sys.stderr)
        return 2
    configure_logging(ns.log_level, ns.log_format)  # the engine core inherits the format
    if ns.zmq_worker is not None:
        from radixserve.core.engine_proc import run_vllm_engine_process

        try:
            rc = run_vllm_engine_process(ns.zmq_worker, engine_config, ns.null_model,
                                         ns.null_step_ms / 1000, ns.shutdown_timeout)
        except ValueError as e:  # a URL of another scheme
            print(f"radixserve: error: {e}", file=sys.stderr)
            return 2
    elif ns.grpc:
        try:
            from radixserve.entrypoints.grpc_worker.server import run_grpc_worker
        except ImportError as e:
            print(f"radixserve: error: --grpc needs the grpc extra "
                  f"(pip install 'radixserve[grpc]'): {e}", file=sys.stderr)
            return 2
        rc = run_grpc_worker(server_config, engine_config, ns.metrics_port, ns.log_level)
    else:
        rc = run_server(server_config, engine_config, log_level=ns.log_level)
    # Everything is cleaned up (engine stopped, IPC files removed); skip the interpreter's
    # finalization, which takes seconds with torch and transformers loaded.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def run_server(server_config: ServerConfig, engine_config: EngineConfig,
               log_level: str = "info") -> int:
    """Run the server until SIGTERM/SIGINT (returns 0) or the engine's death (returns 1)."""
    return asyncio.run(_serve(server_config, engine_config, log_level))


async def _serve(server_config: ServerConfig, engine_config: EngineConfig,
                 log_level: str) -> int:
    import uvicorn

    from radixserve.entrypoints.openai.server import build_app
    from radixserve.frontend.async_client import AsyncEngineClient

    fatal: list[str] = []
    server: _Server | None = None

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        if server is not None:
            server.should_exit = True

    client = AsyncEngineClient(engine_config, null_model=server_config.null_model,
                               null_step_ms=server_config.null_step_ms, on_fatal=on_fatal)
    app = build_app(server_config, client)
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                            log_level=log_level, lifespan="on", access_log=False,
                            timeout_graceful_shutdown=max(1, int(server_config.graceful_timeout_s)),
                            timeout_keep_alive=5,
                            ssl_keyfile=server_config.ssl_keyfile,
                            ssl_certfile=server_config.ssl_certfile,
                            ssl_ca_certs=server_config.ssl_ca_certs,
                            # JSON lines: uvicorn's loggers go through the root handler
                            **({"log_config": None} if server_config.log_format == "json"
                               else {}))
    server = _Server(config, app.state.radixserve, server_config.shutdown_timeout_s)
    try:
        await server.serve()
    finally:
        # lifespan shutdown normally did this; make sure no child survives in any case
        await client.shutdown(server_config.graceful_timeout_s)
    if fatal:
        log.error("exiting: %s", fatal[0])
        return 1
    if not server.started:
        return 1  # could not bind, or the lifespan failed
    return 0


try:
    import uvicorn as _uvicorn

    _ServerBase = _uvicorn.Server
except ImportError:  # pragma: no cover - uvicorn is a dependency
    _ServerBase = object  # type: ignore[assignment,misc]


class _Server(_ServerBase):  # type: ignore[misc,valid-type]
    """uvicorn's server with our signal handling: the first SIGTERM/SIGINT drains
    (``AppState.drain``: the port stays open so new requests get a 503 rather than a refused
    connection, running ones finish for up to ``shutdown_timeout_s``), then uvicorn's own
    shutdown runs; before the model is ready it shuts down at once. A second signal fails the
    running requests and shuts down now; a second SIGINT forces it. The signal is not
    re-raised afterwards, so the process exits 0."""

    def __init__(self, config, state, shutdown_timeout_s: float) -> None:  # noqa: ANN001
        super().__init__(config)
        self._state = state
        self._client = state.client
        self._shutdown_timeout_s = shutdown_timeout_s
        self._drain_task: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        loop = asyncio.get_running_loop()
        sigs = (signal.SIGINT, signal.SIGTERM)
        for sig in sigs:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in sigs:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        first = self._drain_task is None and not self.should_exit
        if first and self._state.serving is not None and self._client.healthy:
            log.info("received %s: draining (up to %g s; a second signal stops at once)",
                     name, self._shutdown_timeout_s)
            self._drain_task = asyncio.ensure_future(self._drain())
            return
        log.info("received %s: shutting down", name)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        self._client.begin_shutdown("server is shutting down")

    async def _drain(self) -> None:
        try:
            await self._state.drain(self._shutdown_timeout_s)
        finally:
            self.should_exit = True
