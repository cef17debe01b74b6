#!/usr/bin/env python
"""Markdown tables from benchmark JSON files, for docs/benchmarks.md.

usage: python benchmarks/tables.py overhead.json [compare.json]
(each file is recognised by its shape: ``bench overhead --json`` or ``bench compare --json``)
"""

from __future__ import annotations

import json
import sys
from typing import Any

from radixserve.bench.overhead import PHASES


def overhead(doc: dict[str, Any]) -> str:
    phases = PHASES
    out = ["| mode | batch | " + " | ".join(phases) + " | total µs / request | median total |",
           "|---|---:|" + "---:|" * (len(phases) + 2)]
    for r in doc["results"]:
        u = r["us_per_step"]
        out.append(f"| {r['mode']} | {r['batch_size']} | "
                   + " | ".join(f"{u[p]:,.0f}" for p in phases)
                   + f" | {r['us_per_request']:.2f} | {r['median_us_per_step']['total']:,.0f} |")
    return "\n".join(out)


def compare(doc: dict[str, Any]) -> str:
    rat = doc.get("ratios", {})
    out = ["**Offline** (all prompts submitted at once)", "",
           "| engine | output tok/s | total tok/s | wall s | radixserve ÷ engine |",
           "|---|---:|---:|---:|---:|"]
    for eng, v in doc.get("offline", {}).items():
        if "output_tokens_per_s" in v:
            r = rat.get("offline", {}).get(eng)
            out.append(f"| {eng} | {v['output_tokens_per_s']:,.1f} | "
                       f"{v['total_tokens_per_s']:,.1f} | {v['wall_s']:.1f} | "
                       + (f"{r:.2f}" if r else "—") + " |")
        else:
            out.append(f"| {eng} | {v.get('status')}: {v.get('reason', '')} | | | |")
    out += ["", "**Serving** (OpenAI `/v1/completions`, streaming, `--max-concurrency c`)", "",
            "| engine | c | requests | output tok/s | median TTFT ms | p99 TTFT ms | "
            "median TPOT ms | median ITL ms | radixserve ÷ engine |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for eng, v in doc.get("serve", {}).items():
        if not v.get("runs"):
            out.append(f"| {eng} | {v.get('status')}: {v.get('reason', '')} "
                       "| | | | | | | |")
            continue
        for x in v["runs"]:
            r = rat.get("serve", {}).get(eng, {}).get(str(x["max_concurrency"]))
            out.append(f"| {eng} | {x['max_concurrency']} | {x['completed']}"
                       f"{'' if not x['failed'] else ' (+' + str(x['failed']) + ' failed)'} | "
                       f"{x['output_throughput']:,.1f} | {x['median_ttft_ms']:,.0f} | "
                       f"{x['p99_ttft_ms']:,.0f} | {x['median_tpot_ms']:,.1f} | "
                       f"{x['median_itl_ms']:,.1f} | " + (f"{r:.2f}" if r else "—") + " |")
    return "\n".join(out)


def main(paths: list[str]) -> None:
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        print(f"<!-- from {p} -->")
        print(overhead(doc) if "results" in doc else compare(doc))
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
