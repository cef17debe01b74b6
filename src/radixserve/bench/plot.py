"""PNG charts for the benchmark JSON documents (matplotlib, headless)."""

from __future__ import annotations

from typing import Any


def _plt():  # noqa: ANN202
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_overhead(doc: dict[str, Any], path: str) -> None:
    """Stacked per-phase bars per batch size (one panel per mode) and total µs per step vs
    batch size on log-log axes with a linear-growth reference line."""
    plt = _plt()
    modes = list(dict.fromkeys(r["mode"] for r in doc["results"]))
    phases = ("schedule", "prepare", "output", "transport")
    fig, axes = plt.subplots(1, len(modes) + 1, figsize=(5 * (len(modes) + 1), 4.2))
    for ax, mode in zip(axes, modes, strict=False):
        rows = [r for r in doc["results"] if r["mode"] == mode]
        x = list(range(len(rows)))
        bottom = [0.0] * len(rows)
        for ph in phases:
            vals = [r["us_per_step"][ph] for r in rows]
            ax.bar(x, vals, bottom=bottom, label=ph)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        tot = [r["us_per_step"]["total"] for r in rows]
        ax.plot(x, tot, "k_", markersize=20, label="total (wall)")
        for xi, t in zip(x, tot, strict=True):
            ax.annotate(f"{t:.0f}", (xi, t), textcoords="offset points", xytext=(0, 4),
                        ha="center", fontsize=8)
        ax.set_xticks(x, [str(r["batch_size"]) for r in rows])
        ax.set_xlabel("running requests (batch size)")
        ax.set_ylabel("µs per step")
        ax.set_title(f"engine core CPU per step, {mode}")
        ax.legend(fontsize=8)
    ax = axes[-1]
    for mode in modes:
        rows = [r for r in doc["results"] if r["mode"] == mode]
        bs = [r["batch_size"] for r in rows]
        ax.loglog(bs, [r["us_per_step"]["total"] for r in rows], "o-", label=mode)
    dec = [r for r in doc["results"] if r["mode"] == modes[0]]
    if dec:
        b0, t0 = dec[-1]["batch_size"], dec[-1]["us_per_step"]["total"]
        bs = [r["batch_size"] for r in dec]
        ax.loglog(bs, [t0 * b / b0 for b in bs], "k:", label="linear in batch")
    ax.set_xlabel("batch size")
    ax.set_ylabel("total µs per step")
    ax.set_title("growth with batch size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_serve(series: dict[str, list[dict[str, Any]]], path: str) -> None:
    """Per engine: output tok/s vs concurrency, and output tok/s vs median TPOT and TTFT
    (the throughput/latency trade-off), points labelled with their concurrency."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, runs in series.items():
        runs = [r for r in runs if r.get("completed")]
        if not runs:
            continue
        conc = [r["max_concurrency"] or r["num_prompts"] for r in runs]
        thr = [r["output_throughput"] for r in runs]
        axes[0].plot(conc, thr, "o-", label=name)
        for ax, key in ((axes[1], "median_tpot_ms"), (axes[2], "median_ttft_ms")):
            lat = [r[key] for r in runs]
            ax.plot(lat, thr, "o-", label=name)
            for c, x, y in zip(conc, lat, thr, strict=True):
                ax.annotate(str(c), (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("max concurrency")
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title("throughput")
    axes[1].set_xlabel("median TPOT (ms)")
    axes[1].set_ylabel("output tokens/s")
    axes[1].set_title("throughput vs time per output token")
    axes[2].set_xlabel("median TTFT (ms)")
    axes[2].set_xscale("log")
    axes[2].set_ylabel("output tokens/s")
    axes[2].set_title("throughput vs time to first token")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_offline(results: dict[str, dict[str, Any]], path: str,
                 step_timers_ms: dict[str, float] | None = None) -> None:
    """Output tokens/s per engine; with step timers, radixserve's mean ms per step by phase."""
    plt = _plt()
    n = 2 if step_timers_ms else 1
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.2), squeeze=False)
    ax = axes[0][0]
    names = list(results)
    vals = [results[k]["output_tokens_per_s"] for k in names]
    bars = ax.bar(names, vals, color=["tab:blue"] + ["tab:gray"] * (len(names) - 1))
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens/s")
    ax.set_title("offline throughput")
    if step_timers_ms:
        ax = axes[0][1]
        keys = list(step_timers_ms)
        bars = ax.bar(keys, [step_timers_ms[k] for k in keys])
        ax.bar_label(bars, fmt="%.2f")
        ax.set_ylabel("ms per step (mean)")
        ax.set_title("radixserve step timers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_compare(doc: dict[str, Any], path: str) -> None:
    """Offline bars plus serving throughput vs concurrency for every engine in a compare
    document."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    off = {k: v for k, v in doc.get("offline", {}).items() if isinstance(v, dict)
           and "output_tokens_per_s" in v}
    ax = axes[0]
    if off:
        names = list(off)
        bars = ax.bar(names, [off[k]["output_tokens_per_s"] for k in names])
        ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens/s")
    ax.set_title("offline (all prompts at once)")
    missing = sorted({k for part in ("offline", "serve") for k, v in doc.get(part, {}).items()
                      if isinstance(v, dict) and v.get("status") in ("unavailable", "failed")})
    if missing:
        fig.text(0.01, 0.01, "not run (unavailable or failed): " + ", ".join(missing),
                 fontsize=8, color="tab:red")
    ax = axes[1]
    for name, entry in doc.get("serve", {}).items():
        runs = entry.get("runs") if isinstance(entry, dict) else None
        if not runs:
            continue
        ax.plot([r["max_concurrency"] for r in runs], [r["output_throughput"] for r in runs],
                "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("output tokens/s")
    ax.set_title("serving (OpenAI API, streaming)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
