"""A VllmEngine ``Generate`` servicer that only streams prebuilt chunks (started by
client.py): ``server.py sync|aio PORT N PACE``. Each stream yields N chunks PACE seconds
apart; on SIGTERM it prints this process's CPU seconds (user + system)."""

import asyncio
import os
import resource
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pbg

MODE, PORT, N, PACE = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
CHUNK = pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[42], prompt_tokens=8,
                                                         completion_tokens=1))


def report(*_: object) -> None:
    r = resource.getrusage(resource.RUSAGE_SELF)
    print(f"cpu {r.ru_utime + r.ru_stime:.3f}", flush=True)
    os._exit(0)


class SyncServicer(pbg.VllmEngineServicer):
    def Generate(self, request, context):  # noqa: ANN001, ANN201, N802 - grpc's names
        for _ in range(N):
            time.sleep(PACE)
            yield CHUNK


class AioServicer(pbg.VllmEngineServicer):
    async def Generate(self, request, context):  # noqa: ANN001, ANN201, N802
        for _ in range(N):
            await asyncio.sleep(PACE)
            yield CHUNK


async def serve_aio() -> None:
    srv = grpc.aio.server()
    pbg.add_VllmEngineServicer_to_server(AioServicer(), srv)
    srv.add_insecure_port(f"127.0.0.1:{PORT}")
    await srv.start()
    print("ready", flush=True)
    await srv.wait_for_termination()


signal.signal(signal.SIGTERM, report)
if MODE == "sync":
    server = grpc.server(ThreadPoolExecutor(max_workers=80))
    pbg.add_VllmEngineServicer_to_server(SyncServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{PORT}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()
else:
    asyncio.run(serve_aio())
