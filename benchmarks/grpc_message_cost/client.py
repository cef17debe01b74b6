"""Server CPU per streamed gRPC message: a VllmEngine ``Generate`` servicer (grpcio's sync
thread-pool server, or grpc.aio) streaming prebuilt chunks to C concurrent streams, N chunks
each, PACE seconds apart (server.py), read by a grpc.aio client in this process.

    python benchmarks/grpc_message_cost/client.py aio|sync C N PACE   (e.g. aio 64 300 0.01)

The CPU figure includes the server's start-up (~0.1 s on the Zen 5 VM: run ``aio 1 1 0`` to
see it)."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pbg

mode, c, n, pace = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
port = 50000 + os.getpid() % 10000
srv = subprocess.Popen([sys.executable, str(Path(__file__).with_name("server.py")), mode,
                        str(port), str(n), str(pace)], stdout=subprocess.PIPE, text=True)
assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"


async def one(stub: pbg.VllmEngineStub) -> int:
    return len([r async for r in stub.Generate(pb.GenerateRequest(request_id="x"))])


async def main() -> tuple[int, float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pbg.VllmEngineStub(ch)
        await one(stub)
        t = time.perf_counter()
        counts = await asyncio.gather(*[one(stub) for _ in range(c)])
        return sum(counts), time.perf_counter() - t


msgs, wall = asyncio.run(main())
srv.send_signal(signal.SIGTERM)
cpu = float(srv.stdout.read().split()[1])
print(f"{mode} c={c} pace={pace}: {msgs} messages in {wall:.2f} s, server CPU {cpu:.2f} s "
      f"(start-up included) -> {cpu / msgs * 1e6:.1f} us per message")
