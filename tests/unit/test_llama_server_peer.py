"""``bench compare``'s llama.cpp peer as llama.cpp's own ``llama-server``: the command line it is
started with, the fall-back to llama-cpp-python's server when the binary is absent, the
per-level restarts (against a stand-in binary that speaks llama-server's HTTP), and, where
``make bench-peers`` built it, the real llama-server on the default model's GGUF answering a
greedy chat completion through the official ``openai`` client."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from radixserve.bench import compare
from radixserve.bench.datasets import BenchPrompt
from radixserve.bench.ports import free_port

REPO = Path(__file__).resolve().parents[2]
PEERS_VENV = REPO / ".venv-peers"


def test_command_line() -> None:
    cmd = compare.llama_server_command("/x/llama-server", "/m/model.gguf", 8123, n_parallel=16,
                                       threads=2, ctx_per_request=256)
    assert cmd[0] == "/x/llama-server"

    def arg(flag: str) -> str:
        assert cmd.count(flag) == 1, flag
        return cmd[cmd.index(flag) + 1]

    assert arg("-m") == "/m/model.gguf"
    assert arg("--host") == "127.0.0.1" and arg("--port") == "8123"
    assert arg("-np") == "16" and arg("-t") == "2"
    assert arg("-c") == str(16 * 256)  # the total, split over the slots
    # greedy as the others: temperature 0 comes with each request; nothing penalises repeats
    assert arg("--repeat-penalty") == "1.0" and arg("--top-k") == "1"
    one = compare.llama_server_command("b", "m.gguf", 1, 1, 4, 512, host="127.0.0.2")
    assert one[one.index("-c") + 1] == "512" and one[one.index("-t") + 1] == "4"
    assert one[one.index("--host") + 1] == "127.0.0.2"
    for bad in ((0, 2, 256), (1, 0, 256), (1, 2, 0)):
        with pytest.raises(ValueError):
            compare.llama_server_command("b", "m.gguf", 1, *bad)


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_fallback_when_the_binary_is_absent(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    venv = tmp_path / "peers"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    assert compare.llama_server_binary(str(venv)) is None
    assert compare.llama_cpp_server_choice(str(venv)) == compare.LLAMA_CPP_PYTHON_SERVER
    # llama-cpp-python importable: its server is the peer, with its limits stated
    monkeypatch.setattr(compare, "_probe", lambda py, code: (True, "0.3.36"))
    st = compare.peer_status(str(venv), ("llama.cpp",))["llama.cpp"]
    assert st["available"] and st["server"] == compare.LLAMA_CPP_PYTHON_SERVER
    assert "one request at a time" in st["limits"] and "llama-server" in st["llama_server"]
    # neither: unavailable, and the reason names both
    monkeypatch.setattr(compare, "_probe",
                        lambda py, code: (False, "ModuleNotFoundError: No module named 'x'"))
    st = compare.peer_status(str(venv), ("llama.cpp",))["llama.cpp"]
    assert not st["available"]
    assert "llama-server" in st["reason"] and "make bench-peers" in st["reason"]


def test_the_binary_is_chosen_when_present(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    venv = tmp_path / "peers"
    _executable(venv / "bin" / "llama-server",
                "#!/bin/sh\necho 'version: 1 (abc)' >&2\necho 'built with cc' >&2\n")
    (venv / "llama-server.build").write_text("llama-cpp-python==0.3.36 -DGGML_NATIVE=ON\n")
    monkeypatch.setattr(compare, "_probe", lambda py, code: pytest.fail("python was probed"))
    assert compare.llama_cpp_server_choice(str(venv)) == compare.LLAMA_SERVER
    st = compare.peer_status(str(venv), ("llama.cpp",))["llama.cpp"]
    assert st == {"available": True, "version": "version: 1 (abc)",
                  "where": str(venv / "bin" / "llama-server"), "server": "llama-server",
                  "built_from": "llama-cpp-python==0.3.36 -DGGML_NATIVE=ON"}
    # a binary that does not run is reported as such, not silently replaced
    _executable(venv / "bin" / "llama-server", "#!/bin/sh\necho 'GLIBC too old' >&2\nexit 1\n")
    monkeypatch.setattr(compare, "_probe", lambda py, code: (False, "ModuleNotFoundError"))
    st = compare.peer_status(str(venv), ("llama.cpp",))["llama.cpp"]
    assert not st["available"] and "GLIBC too old" in st["reason"]


# A stand-in for llama-server: parses the flags compare passes, answers /health, /v1/models and
# streamed /v1/completions (one token per chunk, usage last, then the connection closed, as
# llama-server does) and logs each request body.
FAKE_SERVER = r'''
import argparse, json, sys
from aiohttp import web
ap = argparse.ArgumentParser()
for f in ("-m", "--host", "--port", "-np", "-t", "-c", "--top-k", "--repeat-penalty"):
    ap.add_argument(f)
ap.add_argument("--no-webui", action="store_true")
a = ap.parse_args()
LOG = sys.argv[0] + ".requests"

async def health(req):
    return web.json_response({"status": "ok"})

async def models(req):
    return web.json_response({"object": "list", "data": [{"id": "fake.gguf"}]})

async def completions(req):
    body = await req.json()
    with open(LOG, "a") as f:
        f.write(json.dumps({"np": a.np, "t": a.t, "c": a.c, "m": a.m, "body": body}) + "\n")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(req)
    n = body["max_tokens"]
    for i in range(n):
        chunk = {"choices": [{"index": 0, "text": "x",
                              "finish_reason": "length" if i == n - 1 else None}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}
    await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    req.transport.close()  # as llama-server does after a stream, while promising keep-alive
    return resp

app = web.Application()
app.router.add_get("/health", health)
app.router.add_get("/v1/models", models)
app.router.add_post("/v1/completions", completions)
web.run_app(app, host=a.host, port=int(a.port), print=None)
'''


def test_one_server_per_level(tmp_path: Path) -> None:
    binary = _executable(tmp_path / "bin" / "llama-server",
                         f"#!{sys.executable}\n" + FAKE_SERVER)
    prompts = [BenchPrompt([1, 2, 3], 4, f"prompt {i}") for i in range(6)]
    levels = [1, 4]
    out = compare.run_serve(["llama.cpp"],
                            {"llama.cpp": {"available": True, "server": "llama-server",
                                           "where": str(binary)}},
                            prompts, levels, 2, "unused-dir", "/m/model.gguf", "float32", 2,
                            None, 256, tmp_path, progress=False)["llama.cpp"]
    assert out["status"] == "ok", out
    assert out["server"] == "llama-server" and out["model_id"] == "fake.gguf"
    assert [r["max_concurrency"] for r in out["runs"]] == levels
    assert [r["completed"] for r in out["runs"]] == [2, 4]
    assert all(r["failed"] == 0 and r["total_output_tokens"] == 4 * r["completed"]
               for r in out["runs"])
    assert set(out["startup_s_per_level"]) == {"1", "4"} and out["startup_s"] > 0
    assert " -np 4 " in out["commands"]["4"] and " -c 1024 " in out["commands"]["4"]
    reqs = [json.loads(line) for line in
            Path(str(binary) + ".requests").read_text().splitlines()]
    # each level's prompts went to the server started for that level (after its warm-up)
    assert sorted((r["np"], r["body"]["prompt"]) for r in reqs
                  if r["body"]["prompt"].startswith("prompt")) == (
        [("1", "prompt 0"), ("1", "prompt 1")] + [("4", f"prompt {i}") for i in range(2, 6)])
    assert len(reqs) == 6 + len(levels)
    assert "llama-server, started per level with -np = c" in compare.format_table(
        {"serve": {"llama.cpp": out}})
    for r in reqs:
        assert r["t"] == "2" and r["m"] == "/m/model.gguf" and r["c"] == str(int(r["np"]) * 256)
        body = r["body"]
        assert body["temperature"] == 0.0 and body["repeat_penalty"] == 1.0
        assert body["ignore_eos"] is True


def test_a_server_that_does_not_start_is_reported(tmp_path: Path) -> None:
    binary = _executable(tmp_path / "llama-server", "#!/bin/sh\necho 'no such model' >&2\n"
                                                    "exit 3\n")
    out = compare.run_serve(["llama.cpp"],
                            {"llama.cpp": {"available": True, "server": "llama-server",
                                           "where": str(binary)}},
                            [BenchPrompt([1], 2, "p")], [1], 1, "d", "/m.gguf", "float32", 2,
                            None, 64, tmp_path, progress=False)["llama.cpp"]
    assert out["status"] == "failed" and "no such model" in out["reason"]
    assert "-np 1" in out["reason"] and out["runs"] == []


def test_a_hugging_face_model_needs_llama_gguf(tmp_path: Path) -> None:
    st = {"llama.cpp": {"available": True, "server": "llama-server", "where": "/nope"}}
    out = compare.run_serve(["llama.cpp"], st, [BenchPrompt([1], 2, "p")], [1], 1, "hf-dir",
                            None, "float32", 2, None, 64, tmp_path, progress=False)
    assert out["llama.cpp"]["status"] == "not measured"
    assert "--llama-gguf" in out["llama.cpp"]["reason"]


@pytest.mark.slow
def test_real_llama_server_answers_a_greedy_chat_completion(tmp_path: Path) -> None:
    binary = compare.llama_server_binary(str(PEERS_VENV))
    if binary is None:
        pytest.skip(f"{PEERS_VENV}/bin/llama-server is absent: `make bench-peers` builds it "
                    "(from the llama.cpp source llama-cpp-python vendors)")
    from openai import OpenAI

    from radixserve.model_executor.loader import default_model_path

    port = free_port()
    cmd = compare.llama_server_command(binary, str(default_model_path()), port, n_parallel=2,
                                       threads=2, ctx_per_request=512)
    srv = compare.Server("llama.cpp", cmd, port, tmp_path / "llama-server.log",
                         ready_timeout_s=120, health_path="/health")
    try:
        assert srv.startup_s > 0
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="unused")
        model = client.models.list().data[0].id

        def ask() -> tuple[str, str | None]:
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "What is 2 + 2?"}],
                temperature=0, max_tokens=16)
            return r.choices[0].message.content or "", r.choices[0].finish_reason

        text, finish = ask()
        assert text.strip() and finish in ("stop", "length"), (text, finish)
        assert ask()[0] == text  # greedy: the same answer again
    finally:
        srv.stop()


def test_compare_accepts_llama_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve import cli

    seen: dict = {}

    def fake_run(*args: object, **kwargs: object) -> dict:
        seen.update(kwargs)
        return {"config": {}, "offline": {}, "serve": {}, "ratios": {}}

    monkeypatch.setattr(compare, "run", fake_run)
    assert cli.main(["bench", "compare", "--model", "/hf/dir", "--llama-gguf", "/m/bf16.gguf",
                     "--engines", "radixserve,llama.cpp"]) == 0
    assert seen["llama_gguf"] == "/m/bf16.gguf"
    assert cli.main(["bench", "compare"]) == 0 and seen["llama_gguf"] is None
