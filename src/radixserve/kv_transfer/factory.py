"""Builds connectors by name, loading a connector's module only when it is asked for (vLLM's
``KVConnectorFactory`` does the same), so the engine core never imports a transport."""

from __future__ import annotations

import importlib

from radixserve.config import KVTransferConfig
from radixserve.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker

#: ``kv_connector`` name -> "module:class" of its worker side.
_WORKERS = {
    "NixlConnector": "radixserve.kv_transfer.nixl_connector:NixlConnectorWorker",
    "TcpConnector": "radixserve.kv_transfer.tcp_connector:TcpConnectorWorker",
}


def create_worker_connector(config: KVTransferConfig, model: str) -> KVConnectorWorker:
    """The worker side for ``config.kv_connector`` (call ``register_kv_caches`` next).

    Raises:
        ValueError: an unknown connector name.
        RuntimeError: the connector's transport is not installed (NIXL).
    """
    target = _WORKERS.get(config.kv_connector)
    if target is None:
        raise ValueError(f"kv_transfer_config.kv_connector={config.kv_connector!r} is not one "
                         f"of {', '.join(_WORKERS)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(config, model)


def create_scheduler_connector(config: KVTransferConfig, page_size: int,
                               worker: KVConnectorWorker) -> KVConnectorScheduler:
    """The scheduler side matching ``worker`` (both connectors share ``PullConnectorScheduler``,
    which needs the worker's side-channel address and lease table).

    Raises:
        ValueError: ``worker`` has not registered its KV caches.
    """
    from radixserve.kv_transfer.pull import PullConnectorScheduler

    host, port, leases = (getattr(worker, "host", None), getattr(worker, "port", 0),
                          getattr(worker, "leases", None))
    if leases is None or not port:
        raise ValueError("the worker-side KV connector has no side channel yet "
                         "(register_kv_caches first)")
    return PullConnectorScheduler(config, page_size, host, port, leases)
