"""``radixserve bench offline | serve | overhead | compare | prefix | pd-transfer | pd-serve``
subcommands. Each prints a summary,
writes JSON with ``--json PATH`` and draws PNG charts with ``--plot PATH``. ``make-model`` writes a
random-weight model with a real model's layer shapes for them to measure."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from radixserve.config import QUANTIZATIONS


def _write(results: dict[str, Any], path: str | None, quiet: bool = False) -> None:
    text = json.dumps(results, indent=2)
    if not quiet:
        print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return out


def _err(msg: str) -> int:
    print(f"radixserve: error: {msg}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------- offline
def cmd_offline(ns: argparse.Namespace) -> int:
    from radixserve.bench import datasets as ds
    from radixserve.bench import offline
    from radixserve.entrypoints.engine_args import engine_config_from_args
    from radixserve.model_executor.loader import load_tokenizer, resolve_model

    cfg = engine_config_from_args(ns)
    cfg.seed = ns.seed
    try:
        files = resolve_model(cfg.model)
        tok = load_tokenizer(files.folder)
        if ns.dataset:
            prompts = ds.sharegpt_prompts(ns.dataset, ns.num_prompts, tok, None, ns.seed)
        elif ns.dataset_name == "copy":
            prompts = ds.as_chat(ds.copy_prompts(ns.num_prompts, ns.input_len, None, tok,
                                                 ns.seed), tok)
        elif ns.dataset_name == "chat":
            prompts = ds.as_chat(ds.chat_prompts(ns.num_prompts, ns.input_len, ns.output_len,
                                                 tok, ns.seed), tok)
        else:
            special = set(tok.all_special_ids)
            prompts = ds.random_prompts(ns.num_prompts, ns.input_len, ns.output_len,
                                        ns.range_ratio, len(tok), ns.seed, special,
                                        ns.output_range_ratio)
    except ValueError as e:
        return _err(str(e))
    kwargs = {k: v for k, v in vars(cfg).items() if k != "extra"}
    res: dict[str, Any] = {"config": {"num_prompts": len(prompts), "input_len": ns.input_len,
                                      "output_len": ns.output_len,
                                      "range_ratio": ns.range_ratio, "dtype": cfg.dtype,
                                      "dataset": ns.dataset or ns.dataset_name,
                                      "ignore_eos": not ns.no_ignore_eos,
                                      "step_timers": cfg.step_timers, "model": files.name,
                                      "speculative_config":
                                      None if cfg.speculative_config is None
                                      else vars(cfg.speculative_config)}}
    rs = offline.run_radixserve(prompts, kwargs, ignore_eos=not ns.no_ignore_eos)
    res["radixserve"] = offline.as_dict(rs)
    if ns.compare_transformers:
        hf = offline.run_transformers(prompts, cfg.model, cfg.dtype, ns.hf_batch_size)
        res["transformers"] = offline.as_dict(hf)
        res["ratio_output_tokens_per_s"] = rs.output_tokens_per_s / hf.output_tokens_per_s
    _write(res, ns.json)
    if ns.plot:
        from radixserve.bench.plot import plot_offline

        engines = {k: res[k] for k in ("radixserve", "transformers") if k in res}
        plot_offline(engines, ns.plot, (rs.extra or {}).get("step_timers_ms"))
    return 0


# ---------------------------------------------------------------------- overhead
def cmd_prefix(ns: argparse.Namespace) -> int:
    from radixserve.bench.prefix import run_prefix_ttft
    from radixserve.entrypoints.engine_args import engine_config_from_args

    cfg = engine_config_from_args(ns)
    kwargs = {k: v for k, v in vars(cfg).items() if k != "extra"}
    try:
        res = run_prefix_ttft(kwargs, ns.prefix_len, ns.suffix_len, ns.repeats, ns.seed)
    except ValueError as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2
    _write(res, ns.json)
    return 0


def cmd_overhead(ns: argparse.Namespace) -> int:
    from radixserve.bench import overhead

    cfg = overhead.OverheadConfig(prompt_len=ns.prompt_len, prefill_len=ns.prefill_len,
                                  steps=ns.steps, warmup=ns.warmup, page_size=ns.page_size,
                                  seed=ns.seed, overlap=not ns.disable_overlap)
    modes = ["decode", "mixed"] if ns.mode == "both" else [ns.mode]
    doc = overhead.run(ns.batch_sizes, modes, cfg, ns.repeat)
    print(overhead.format_table(doc))
    print("(µs per step: mean over measured steps; total is the whole step's wall time)")
    _write(doc, ns.json, quiet=True)
    if ns.plot:
        from radixserve.bench.plot import plot_overhead

        plot_overhead(doc, ns.plot)
    return 0


# ---------------------------------------------------------------------- serve
def _serve_prompts(ns: argparse.Namespace, tok: Any, seed: int, num: int) -> list:
    from radixserve.bench import datasets as ds

    if ns.dataset_name == "sharegpt":
        if not ns.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE")
        return ds.sharegpt_prompts(ns.dataset_path, num, tok, ns.sharegpt_output_len, seed)
    if ns.dataset_name == "shared-prefix":
        return ds.shared_prefix_prompts(ns.sp_num_groups, ns.sp_prompts_per_group,
                                        ns.sp_system_len, ns.sp_question_len, ns.sp_output_len,
                                        tok, seed)
    if ns.dataset_name == "copy":
        return ds.copy_prompts(num, ns.random_input_len, None, tok, seed)
    if ns.dataset_name == "chat":
        return ds.chat_prompts(num, ns.random_input_len, ns.random_output_len, tok, seed)
    return ds.random_text_prompts(num, ns.random_input_len, ns.random_output_len,
                                  ns.random_range_ratio, tok, seed)


def cmd_serve(ns: argparse.Namespace) -> int:
    import httpx

    from radixserve.bench import serve
    from radixserve.model_executor.loader import load_tokenizer, resolve_model

    base = ns.base_url.rstrip("/")
    try:
        model = ns.model or serve.fetch_model_id(base)
    except (httpx.HTTPError, RuntimeError) as e:
        return _err(f"cannot list models at {base}/v1/models: {e}")
    extra = json.loads(ns.extra_body) if ns.extra_body else None
    if ns.json_schema:
        # the same prompts, each constrained by this schema (structured-output cost)
        text = ns.json_schema
        if not text.lstrip().startswith("{"):
            with open(text) as f:
                text = f.read()
        extra = {**(extra or {}), "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": json.loads(text), "strict": True}}}
    levels: list[int | None] = list(ns.sweep_concurrency) if ns.sweep_concurrency else [
        ns.max_concurrency]
    runs = []
    try:
        tok = load_tokenizer(resolve_model(ns.tokenizer).folder)
    except ValueError as e:
        return _err(str(e))
    for i, c in enumerate(levels):
        # each level gets its own prompts (seed + i), at least as many as its concurrency,
        # so no level is served from the prefix cache the previous one filled
        try:
            batch = _serve_prompts(ns, tok, ns.seed + i, max(ns.num_prompts, c or 0))
        except ValueError as e:
            return _err(str(e))
        spec0 = serve.fetch_spec_counts(base)
        try:
            runs.append(serve.run(base, ns.endpoint, model, batch,
                                  request_rate=ns.request_rate, max_concurrency=c,
                                  ignore_eos=not ns.no_ignore_eos,
                                  temperature=ns.temperature, seed=ns.seed,
                                  burstiness=ns.burstiness, num_warmups=ns.num_warmups,
                                  timeout_s=ns.timeout, progress=not ns.disable_tqdm,
                                  extra_body=extra))
        except RuntimeError as e:
            return _err(str(e))
        spec1 = serve.fetch_spec_counts(base) if spec0 is not None else None
        if spec0 is not None and spec1 is not None:
            # the server's counters over this level (warm-up requests included): drafts,
            # draft and accepted tokens, mean accepted length
            from radixserve.bench.offline import spec_decode_summary

            runs[-1]["spec_decode"] = spec_decode_summary(spec0, spec1)
    doc = {"config": {"base_url": base, "endpoint": serve.ENDPOINTS[ns.endpoint],
                      "model": model, "dataset": ns.dataset_name,
                      "num_prompts": ns.num_prompts,
                      "request_rate": "inf" if math.isinf(ns.request_rate) else ns.request_rate,
                      "max_concurrency": ns.max_concurrency,
                      "sweep_concurrency": ns.sweep_concurrency,
                      "ignore_eos": not ns.no_ignore_eos, "temperature": ns.temperature,
                      "json_schema": ns.json_schema},
           "runs": runs}
    print(serve.format_table(runs))
    for r in runs:
        if r["cached_prompt_tokens"] is not None:
            print(f"c={r['max_concurrency']}: server reported {r['cached_prompt_tokens']} "
                  f"cached prompt tokens ({100 * r['cached_prompt_fraction']:.1f}% of prompts)")
        for e in r["errors"]:
            print(f"c={r['max_concurrency']}: error: {e}", file=sys.stderr)
    _write(doc, ns.json, quiet=True)
    if ns.plot:
        from radixserve.bench.plot import plot_serve

        plot_serve({ns.label or model: runs}, ns.plot)
    return 0 if all(r["completed"] for r in runs) else 1


# ---------------------------------------------------------------------- compare
def cmd_compare(ns: argparse.Namespace) -> int:
    from radixserve.bench import compare

    engines = [e.strip() for e in ns.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in compare.ENGINES]
    if bad:
        return _err(f"unknown engine(s) {', '.join(bad)}; choose from "
                    f"{', '.join(compare.ENGINES)}")
    doc = compare.run(engines, ns.num_prompts, ns.input_len, ns.output_len, ns.dtype,
                      ns.concurrency, ns.prompts_per_level, ns.model, ns.peers_venv,
                      ns.threads, not ns.skip_offline, not ns.skip_serve, ns.workdir, ns.seed,
                      progress=not ns.disable_tqdm, llama_gguf=ns.llama_gguf,
                      quantization=ns.quantization)
    print(compare.format_table(doc))
    _write(doc, ns.json, quiet=True)
    if ns.plot:
        from radixserve.bench.plot import plot_compare

        plot_compare(doc, ns.plot)
    return 0


# ---------------------------------------------------------------------- parser
# ---------------------------------------------------------------------- pd
def cmd_pd_transfer(ns: argparse.Namespace) -> int:
    from radixserve.bench import pd

    res = pd.run_transfer(ns.tokens, ns.connectors.split(","), ns.page_size, ns.model,
                          ns.dtype, ns.repeats)
    _write(res, ns.json, quiet=True)
    print(pd.format_transfer(res))
    return 0


def cmd_pd_serve(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from radixserve.bench import pd

    setups = ["pd", "colocated"] if ns.setups == "both" else ns.setups.split(",")
    bad = [x for x in setups if x not in ("pd", "colocated")]
    if bad:
        raise SystemExit(f"--setups: unknown setup {bad[0]!r} (pd, colocated, pd,colocated "
                         "or both)")
    res = pd.run_serve(connector=ns.connector, num_requests=ns.num_requests,
                       long_every=ns.long_every, short_len=ns.short_input_len,
                       long_len=ns.long_input_len, output_len=ns.output_len,
                       long_output_len=ns.long_output_len, rate=ns.request_rate,
                       threads=ns.threads, dtype=ns.dtype, num_pages=ns.num_pages,
                       workdir=Path(ns.workdir), seed=ns.seed, setups=setups)
    _write(res, ns.json, quiet=True)
    print(pd.format_serve(res))
    return 0


# ---------------------------------------------------------------------- make-model
def cmd_make_model(ns: argparse.Namespace) -> int:
    from radixserve.bench import make_model

    try:
        made = make_model.make_model(
            ns.shape, ns.out, gguf=ns.gguf, seed=ns.seed, num_layers=ns.num_layers,
            vocab_size=ns.vocab_size, peers_venv=ns.peers_venv,
            log=lambda line: print(line, file=sys.stderr, flush=True))
    except (ValueError, RuntimeError, OSError) as e:
        return _err(str(e))
    print(f"wrote {made.folder}: {made.shape}, {made.num_parameters / 1e9:.3f} B parameters, "
          f"{made.safetensors_bytes / 1e9:.2f} GB bfloat16 in {made.num_shards} shard(s)")
    if made.gguf is not None and made.gguf_bytes is not None:
        print(f"wrote {made.gguf} ({made.gguf_bytes / 1e9:.2f} GB)")
    print(f"{make_model.NOTE} ({made.seconds:.1f} s)")
    return 0


# ---------------------------------------------------------------------- quant-kernels
def cmd_quant_kernels(ns: argparse.Namespace) -> int:
    from radixserve.bench.quant_kernels import run_quant_bench

    try:
        res = run_quant_bench(ns.n, ns.k, tuple(ns.m), tuple(ns.types), ns.min_time,
                              threads=ns.threads, yardsticks=not ns.no_yardsticks)
    except (ValueError, RuntimeError) as e:
        return _err(str(e))
    print(f"y[M, {ns.n}] = x[M, {ns.k}] @ W^T, {res['threads']} threads, kernels {res['isa']}: "
          "microseconds per call (GB/s of weight bytes)")
    for r in res["rows"]:
        print(f"  {r['kernel']:<28} M={r['m']:<4} {r['us']:>10.1f} us  ({r['gb_s']:.1f} GB/s)")
    _write(res, ns.json, quiet=True)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its subcommands to the top-level parser."""
    from radixserve.entrypoints.engine_args import add_engine_args

    b = sub.add_parser("bench", help="benchmarks (JSON output, PNG charts)")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)

    o = bsub.add_parser("offline", help="offline throughput through LLM.generate")
    o.add_argument("--num-prompts", type=int, default=64)
    o.add_argument("--input-len", type=int, default=256)
    o.add_argument("--output-len", type=int, default=128)
    o.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len]")
    o.add_argument("--output-range-ratio", type=float, default=None,
                   help="the same for output lengths (default: --range-ratio)")
    o.add_argument("--dataset", default=None, help="ShareGPT-format JSON file")
    o.add_argument("--dataset-name", choices=("random", "copy", "chat"), default="random",
                   help="without --dataset: random token prompts; copy: repeat a passage "
                        "changing one word (--input-len tokens, output as long as the "
                        "passage: speculation's case); chat: a question after background "
                        "(--input-len, --output-len); copy and chat go through the chat "
                        "template")
    o.add_argument("--no-ignore-eos", action="store_true")
    o.add_argument("--compare-transformers", action="store_true",
                   help="also run HF transformers batched generate on the same prompts")
    o.add_argument("--hf-batch-size", type=int, default=None)
    o.add_argument("--json", default=None, help="write results to this file")
    o.add_argument("--plot", default=None, help="write a PNG chart to this file")
    o.add_argument("--seed", type=int, default=0, help="dataset and engine seed")
    add_engine_args(o, skip=("seed",))
    o.set_defaults(func=cmd_offline)

    v = bsub.add_parser("overhead", help="engine-core CPU µs per step with a null model")
    v.add_argument("--batch-sizes", type=_ints, default=[1, 16, 64, 256, 1024],
                   help="comma-separated running-request counts")
    v.add_argument("--mode", choices=("decode", "mixed", "both"), default="both")
    v.add_argument("--steps", type=int, default=200, help="measured steps per case")
    v.add_argument("--warmup", type=int, default=20)
    v.add_argument("--prompt-len", type=int, default=128,
                   help="prompt tokens of each decoding request")
    v.add_argument("--prefill-len", type=int, default=512,
                   help="tokens prefilled per step in mixed mode")
    v.add_argument("--page-size", type=int, default=16)
    v.add_argument("--disable-overlap", action="store_true",
                   help="run the engine without overlap scheduling (forward inline)")
    v.add_argument("--repeat", type=int, default=1,
                   help="run each case N times and keep the least disturbed (lowest mean)")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--json", default=None, help="write results to this file")
    v.add_argument("--plot", default=None, help="write a PNG chart to this file")
    v.set_defaults(func=cmd_overhead)

    s = bsub.add_parser("serve", help="OpenAI-API load generator against a running server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions")
    s.add_argument("--model", default=None, help="model name to send (default: the first of "
                                                 "/v1/models)")
    s.add_argument("--tokenizer", default=None,
                   help="model folder or GGUF whose tokenizer builds the prompts (default: "
                        "radixserve's default model)")
    s.add_argument("--dataset-name", choices=("random", "shared-prefix", "sharegpt", "copy",
                                              "chat"), default="random",
                   help="copy: repeat a passage changing one word (--random-input-len "
                        "tokens, output as long as the passage; use --endpoint chat); chat: "
                        "a question after background (--random-input-len, "
                        "--random-output-len)")
    s.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    s.add_argument("--num-prompts", type=int, default=64)
    s.add_argument("--random-input-len", type=int, default=256)
    s.add_argument("--random-output-len", type=int, default=128)
    s.add_argument("--random-range-ratio", type=float, default=0.0)
    s.add_argument("--sharegpt-output-len", type=int, default=None)
    s.add_argument("--shared-prefix-groups", dest="sp_num_groups", type=int, default=4)
    s.add_argument("--shared-prefix-prompts-per-group", dest="sp_prompts_per_group", type=int,
                   default=16)
    s.add_argument("--shared-prefix-len", dest="sp_system_len", type=int, default=512,
                   help="tokens of each group's shared system prompt")
    s.add_argument("--shared-prefix-question-len", dest="sp_question_len", type=int,
                   default=64)
    s.add_argument("--shared-prefix-output-len", dest="sp_output_len", type=int, default=128)
    s.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals (inf: all at once)")
    s.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times (1 = Poisson)")
    s.add_argument("--max-concurrency", type=int, default=None)
    s.add_argument("--sweep-concurrency", type=_ints, default=None,
                   help="e.g. 1,4,16,64: one run per level (at least that many prompts each)")
    s.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (outputs may stop early)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    s.add_argument("--json-schema", default=None,
                   help="constrain every request by this JSON schema (a file or inline JSON), "
                        "sent as response_format json_schema strict")
    s.add_argument("--num-warmups", type=int, default=1)
    s.add_argument("--timeout", type=float, default=6 * 3600.0,
                   help="per-request timeout (s; default 6 hours, as vLLM's benchmark)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--label", default=None, help="series name in the plot")
    s.add_argument("--disable-tqdm", action="store_true")
    s.add_argument("--json", default=None, help="write results to this file")
    s.add_argument("--plot", default=None, help="write a PNG chart to this file")
    s.set_defaults(func=cmd_serve)

    c = bsub.add_parser("compare", help="radixserve vs peer engines on the same prompts")
    c.add_argument("--engines", default="radixserve,transformers,llama.cpp,vllm")
    c.add_argument("--model", default=None)
    c.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="one dtype for every engine (auto: what radixserve picks on this CPU)")
    c.add_argument("--num-prompts", type=int, default=64, help="offline prompts")
    c.add_argument("--input-len", type=int, default=64)
    c.add_argument("--output-len", type=int, default=128)
    c.add_argument("--concurrency", type=_ints, default=[1, 16, 64])
    c.add_argument("--prompts-per-level", type=int, default=8,
                   help="serving requests per level (at least the level)")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--peers-venv", default=".venv-peers")
    c.add_argument("--llama-gguf", default=None, metavar="FILE",
                   help="the GGUF llama.cpp serves (default: MODEL when it is a GGUF), e.g. a "
                        "BF16 GGUF of the Hugging Face folder MODEL")
    c.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="radixserve's --quantization (default: its own choice; for a GGUF "
                        "measured on this machine)")
    c.add_argument("--skip-offline", action="store_true")
    c.add_argument("--skip-serve", action="store_true")
    c.add_argument("--workdir", default=None, help="server logs and scratch files")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--disable-tqdm", action="store_true")
    c.add_argument("--json", default=None)
    c.add_argument("--plot", default=None)
    c.set_defaults(func=cmd_compare)

    x = bsub.add_parser("prefix", help="TTFT with a cached long prefix vs prefix caching off")
    x.add_argument("--prefix-len", type=int, default=1000)
    x.add_argument("--suffix-len", type=int, default=32)
    x.add_argument("--repeats", type=int, default=5)
    x.add_argument("--seed", type=int, default=0)
    x.add_argument("--json", default=None)
    add_engine_args(x, skip=("seed", "enable_prefix_caching"))
    x.set_defaults(func=cmd_prefix)

    t = bsub.add_parser("pd-transfer", help="KV transfer GB/s between two processes per "
                                            "connector, vs memcpy")
    t.add_argument("--tokens", type=int, default=4096, help="prompt tokens whose KV moves")
    t.add_argument("--connectors", default="NixlConnector,TcpConnector")
    t.add_argument("--page-size", type=int, default=16)
    t.add_argument("--model", default=None)
    t.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    t.add_argument("--repeats", type=int, default=5)
    t.add_argument("--json", default=None)
    t.set_defaults(func=cmd_pd_transfer)

    d = bsub.add_parser("pd-serve", help="TTFT/ITL of 1 prefill + 1 decode instance vs two "
                                         "colocated ones behind vllm-router")
    d.add_argument("--connector", default="NixlConnector",
                   choices=("NixlConnector", "TcpConnector"))
    d.add_argument("--setups", default="pd,colocated", help="pd, colocated, or both (= pd,colocated, the default)")
    d.add_argument("--num-requests", type=int, default=64)
    d.add_argument("--long-every", type=int, default=8,
                   help="one long prompt per this many requests (0: none)")
    d.add_argument("--short-input-len", type=int, default=128)
    d.add_argument("--long-input-len", type=int, default=2048)
    d.add_argument("--output-len", type=int, default=64)
    d.add_argument("--long-output-len", type=int, default=16)
    d.add_argument("--request-rate", type=float, default=1.0, help="requests/s, Poisson")
    d.add_argument("--threads", type=int, default=1, help="torch threads per instance")
    d.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    d.add_argument("--num-pages", type=int, default=1024)
    d.add_argument("--workdir", default="pd-bench", help="server and router logs")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", default=None)
    d.set_defaults(func=cmd_pd_serve)

    from radixserve.bench.make_model import GGUF_TYPES, SHAPES

    m = bsub.add_parser(
        "make-model",
        help="write a random-weight model with a real model's exact layer shapes (gibberish "
             "text, real speed)",
        description="Write a Hugging Face folder (config.json, bfloat16 safetensors shards, the "
                    "default model's tokenizer) holding random weights with the exact layer "
                    "shapes of a real model, so benchmarks measure real-size models without "
                    "downloading anything. The text it generates is gibberish; its speed is "
                    "real.")
    m.add_argument("--shape", required=True, metavar="NAME",
                   help=f"the real model whose shapes to copy: {', '.join(SHAPES)}")
    m.add_argument("out", metavar="OUT", help="folder to create (must not exist or be empty)")
    m.add_argument("--gguf", default=None, metavar="TYPE",
                   help=f"also write OUT/<shape>-<TYPE>.gguf with the same weights: "
                        f"{', '.join(GGUF_TYPES)} (the K types need `make bench-peers`)")
    m.add_argument("--seed", type=int, default=0, help="weights' seed")
    m.add_argument("--num-layers", type=int, default=None,
                   help="override the layer count (tests, quick runs)")
    m.add_argument("--vocab-size", type=int, default=None,
                   help="override the vocabulary (at least the tokenizer's 49152 tokens)")
    m.add_argument("--peers-venv", default=".venv-peers",
                   help="venv with llama-cpp-python, for the K-quant GGUF types "
                        "(default: .venv-peers)")
    m.set_defaults(func=cmd_make_model)

    q = bsub.add_parser("quant-kernels",
                        help="the GGUF-quantized linear kernels against torch's int4 GEMM and "
                             "float32 F.linear, weights streamed from memory")
    q.add_argument("--n", type=int, default=8960, help="output features")
    q.add_argument("--k", type=int, default=1536, help="input features (K-quants: x256)")
    q.add_argument("--m", type=_ints, default=[1, 4, 16, 64], help="activation rows")
    q.add_argument("--types", type=lambda t: t.split(","), default=["Q4_0", "Q4_K"],
                   help="ggml types, comma-separated "
                        "(Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q4_K,Q5_K,Q6_K)")
    q.add_argument("--min-time", type=float, default=0.5, help="seconds per configuration")
    q.add_argument("--threads", type=int, default=None)
    q.add_argument("--no-yardsticks", action="store_true",
                   help="skip torch's int4 GEMM and float32 F.linear")
    q.add_argument("--json", default=None)
    q.set_defaults(func=cmd_quant_kernels)
