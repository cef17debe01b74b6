"""``radixserve serve | fleet | generate | bench``: one entry point, engine flags generated from
``EngineConfig`` so they carry the same names as the offline ``LLM`` arguments."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import typing
from collections.abc import Callable

from radixserve.entrypoints.engine_args import add_engine_args, engine_config_from_args


def _fail(msg: str) -> typing.NoReturn:
    print(f"radixserve: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


# ---------------------------------------------------------------------- generate
def cmd_generate(ns: argparse.Namespace) -> int:
    from radixserve.entrypoints.llm import LLM
    from radixserve.sampling_params import SamplingParams

    try:
        sp = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, seed=ns.seed,
                            top_p=ns.top_p, top_k=ns.top_k)
        cfg = engine_config_from_args(ns)
        cfg.seed = ns.seed if ns.seed is not None else 0
        t0 = time.perf_counter()
        llm = LLM(**dataclasses.asdict(cfg))
        t1 = time.perf_counter()
        if ns.chat:
            out = llm.chat([{"role": "user", "content": ns.prompt}], sp, use_tqdm=False)[0]
        else:
            out = llm.generate(ns.prompt, sp, use_tqdm=False)[0]
        t2 = time.perf_counter()
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    c = out.outputs[0]
    if ns.json:
        ttft = out.metrics.ttft if out.metrics else None
        print(json.dumps({
            "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
            "prompt_token_ids": out.prompt_token_ids, "model": llm.model_info.name,
            "timings": {"load_s": t1 - t0, "generate_s": t2 - t1, "ttft_s": ttft,
                        "output_tokens_per_s": len(c.token_ids) / max(t2 - t1, 1e-9)}}))
    else:
        print(c.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(g, skip=("seed",))
    g.set_defaults(func=cmd_generate)
    for register in _subcommand_registrars():
        register(sub)
    return p


def _subcommand_registrars() -> list[Callable[[argparse._SubParsersAction], None]]:
    """Subcommands living in their own modules (server, bench) register themselves."""
    out = []
    for mod in ("radixserve.entrypoints.serve_cli", "radixserve.entrypoints.fleet",
                "radixserve.bench.cli"):
        try:
            m = __import__(mod, fromlist=["register"])
        except ImportError as e:
            if e.name != mod:
                raise
            continue
        out.append(m.register)
    return out


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    p = build_parser()
    ns = p.parse_args(argv)
    return int(ns.func(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())
