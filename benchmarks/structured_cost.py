"""Structured-output cost per engine step at batch 64, in-process (no HTTP in the way).

The same 64 chat prompts, ``--max-tokens`` tokens each (``ignore_eos``), are generated with and
without a JSON schema, alternated ``--repeats`` times. Besides the median decode step (the
engine's own step timers), the grammar's own work inside each step is timed: mask fills, the
bitmask applies and the token accepts (``structured.runtime.GrammarStep`` and the sampler's
``_apply_bitmask``), and the fraction of constrained rows that needed a mask at all.

    .venv/bin/python benchmarks/structured_cost.py --repeats 3 --json docs/benchmarks/structured-cost.json

The default schema is an array of at least 50 small objects, so no request completes it within
128 tokens and every step has 64 constrained rows. The end-to-end comparison over HTTP is
``radixserve bench serve --json-schema FILE`` against the same prompts without it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import radixserve.model_executor.sampler as sampler
import radixserve.structured.runtime as runtime
from radixserve import LLM, SamplingParams
from radixserve.sampling_params import StructuredOutputsParams

PEOPLE = {"type": "array", "minItems": 50, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Lima", "Oslo"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}}

spent = {"fill": 0.0, "accept": 0.0, "apply": 0.0}
rows = {"constrained": 0, "masked": 0}


def _timed(owner: Any, name: str, key: str) -> None:
    f = getattr(owner, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spent[key] += time.perf_counter() - t

    setattr(owner, name, wrapper)


def _count() -> None:
    fill, step = runtime.GrammarStep.fill, runtime.GrammarRuntime.step

    def counted_fill(self: Any, r: Any) -> Any:
        rows["masked"] += len(r)
        return fill(self, r)

    def counted_step(self: Any, grammars: Any) -> Any:
        st = step(self, grammars)
        rows["constrained"] += len(st.rows)
        return st

    runtime.GrammarStep.fill = counted_fill
    runtime.GrammarRuntime.step = counted_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--schema", default=None, help="JSON schema file (default: PEOPLE)")
    ap.add_argument("--json", default=None, help="write the results here")
    ns = ap.parse_args()
    schema = PEOPLE
    if ns.schema is not None:
        with open(ns.schema) as f:
            schema = json.load(f)
    _count()
    _timed(runtime.GrammarStep, "fill", "fill")
    _timed(runtime.GrammarStep, "accept", "accept")
    _timed(sampler, "_apply_bitmask", "apply")
    llm = LLM(dtype=ns.dtype, max_num_seqs=ns.batch, num_pages=2048, seed=0, step_timers=True)
    eng = llm.engine
    msgs = [[{"role": "user", "content": f"List fifty people (group {i}) with name, age and "
                                         "city as a JSON array."}] for i in range(ns.batch)]
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "schema": []}
    for _ in range(ns.repeats):
        for mode in runs:
            so = StructuredOutputsParams(json=schema) if mode == "schema" else None
            sp = SamplingParams(temperature=0, max_tokens=ns.max_tokens, ignore_eos=True,
                                structured_outputs=so)
            eng.drain_step_timings()
            for k in spent:
                spent[k] = 0.0
            rows["constrained"] = rows["masked"] = 0
            s0, t0 = eng.step_count, time.perf_counter()
            llm.chat(msgs, sp, use_tqdm=False)
            wall, steps = time.perf_counter() - t0, eng.step_count - s0
            tm = eng.drain_step_timings()
            step = sorted(sum(x) for x in zip(tm["schedule"], tm["prepare"], tm["forward"],
                                              tm["output"], strict=True))
            decode = step[:max(1, len(step) - 8)]  # the slowest few are the prefill steps
            run = {"wall_s": round(wall, 3), "steps": steps,
                   "step_ms_median": round(1e3 * statistics.median(decode), 2),
                   "grammar_ms_per_step": {k: round(1e3 * v / steps, 3)
                                           for k, v in spent.items()},
                   "masked_row_fraction": round(rows["masked"] / max(1, rows["constrained"]),
                                                4)}
            runs[mode].append(run)
            print(mode, json.dumps(run), flush=True)
    med = {m: statistics.median(r["step_ms_median"] for r in runs[m]) for m in runs}
    grammar = statistics.median(sum(r["grammar_ms_per_step"].values()) for r in runs["schema"])
    summary = {"batch": ns.batch, "max_tokens": ns.max_tokens, "dtype": ns.dtype,
               "median_step_ms": med, "grammar_ms_per_step": round(grammar, 3),
               "grammar_share_of_step": round(grammar / med["plain"], 4), "runs": runs}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
