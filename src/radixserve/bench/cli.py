"""``radixserve bench ...`` subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _write(results: dict[str, Any], path: str | None) -> None:
    text = json.dumps(results, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def cmd_offline(ns: argparse.Namespace) -> int:
    from radixserve.bench import offline
    from radixserve.bench.datasets import random_prompts, sharegpt_prompts
    from radixserve.cli import engine_config_from_args
    from radixserve.model_executor.loader import load_tokenizer, resolve_model

    cfg = engine_config_from_args(ns)
    cfg.seed = ns.seed
    try:
        files = resolve_model(cfg.model)
        tok = load_tokenizer(files.folder)
    except ValueError as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2
    if ns.dataset:
        prompts = sharegpt_prompts(ns.dataset, ns.num_prompts, tok, None, ns.seed)
    else:
        special = set(tok.all_special_ids)
        prompts = random_prompts(ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio,
                                 len(tok), ns.seed, special)
    kwargs = {k: v for k, v in vars(cfg).items() if k != "extra"}
    res: dict[str, Any] = {"config": {"num_prompts": len(prompts), "input_len": ns.input_len,
                                      "output_len": ns.output_len,
                                      "range_ratio": ns.range_ratio, "dtype": cfg.dtype,
                                      "model": files.name}}
    rs = offline.run_radixserve(prompts, kwargs, ignore_eos=not ns.no_ignore_eos)
    res["radixserve"] = offline.as_dict(rs)
    if ns.compare_transformers:
        hf = offline.run_transformers(prompts, cfg.model, cfg.dtype, ns.hf_batch_size)
        res["transformers"] = offline.as_dict(hf)
        res["ratio_output_tokens_per_s"] = rs.output_tokens_per_s / hf.output_tokens_per_s
    _write(res, ns.json)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its subcommands to the top-level parser."""
    from radixserve.cli import add_engine_args

    b = sub.add_parser("bench", help="benchmarks (JSON output)")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    o = bsub.add_parser("offline", help="offline throughput through LLM.generate")
    o.add_argument("--num-prompts", type=int, default=64)
    o.add_argument("--input-len", type=int, default=256)
    o.add_argument("--output-len", type=int, default=128)
    o.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len]")
    o.add_argument("--dataset", default=None, help="ShareGPT-format JSON file")
    o.add_argument("--no-ignore-eos", action="store_true")
    o.add_argument("--compare-transformers", action="store_true",
                   help="also run HF transformers batched generate on the same prompts")
    o.add_argument("--hf-batch-size", type=int, default=None)
    o.add_argument("--json", default=None, help="write results to this file")
    o.add_argument("--seed", type=int, default=0, help="dataset and engine seed")
    add_engine_args(o, skip=("seed",))
    o.set_defaults(func=cmd_offline)
