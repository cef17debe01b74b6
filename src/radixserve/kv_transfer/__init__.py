"""Prefill/decode disaggregation: KV connectors shaped like vLLM V1's
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).

A prefill instance computes a prompt's KV and keeps its pages under a lease; a decode instance
reads the pages it lacks and generates. ``base.py`` is the connector API the engine core calls
(a scheduler-side and a worker-side object); ``params.py`` the ``kv_transfer_params`` that the
API layers carry; ``pull.py`` the scheduler side both connectors share; ``worker.py`` the
worker side's jobs, leases and side channel; ``nixl_connector.py`` and ``tcp_connector.py``
how bytes move. The engine core imports ``base``, ``params`` and ``factory`` only; the factory
loads a connector's module by name, so no connector's transport is an import of the core.
"""
