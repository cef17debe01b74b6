"""radixserve as a gRPC engine worker behind smg (the Shepherd Model Gateway): the
``vllm.grpc.engine.VllmEngine`` service from ``smg-grpc-proto`` over the engine-core process
(``radixserve serve --grpc``). Needs the ``grpc`` extra (``pip install 'radixserve[grpc]'``).

Modules: ``translate`` (proto <-> engine types), ``servicer`` (the RPCs), ``tokenizer_bundle``
(``GetTokenizer``'s zip), ``server`` (the process: gRPC server, side metrics port, signals).
"""
