"""docs/metrics.md and docs/grafana-dashboard.json checked against the server's metric
registry, so neither can drift from the code: every metric the dashboard queries exists with
the labels it groups by, rate() and histogram_quantile() get series of the right type, and the
metrics page lists exactly the registry's metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from radixserve.engine_types import (
    KVTransferStats,
    RunnerStats,
    SchedulerStats,
    ShadowStats,
    SpecDecodeCounts,
)
from radixserve.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"
METRICS_DOC = ROOT / "docs" / "metrics.md"

#: a radixserve series name in a PromQL expression or a Markdown page
NAME = re.compile(r"radixserve:[A-Za-z_][A-Za-z0-9_]*")
#: labels Prometheus adds to every scraped series
SCRAPE_LABELS = {"instance", "job"}


def _series() -> dict[str, tuple[str, str, frozenset[str]]]:
    """Every sample name the registry writes -> (family name, family type, label names).

    Every labelled family gets a child first (a finished request, runner and shadow stats, a
    KV connector's figures), so that its samples, and with them its labels, are written.
    """
    m = ServerMetrics(model_name="m")
    m.update_from_stats(SchedulerStats(
        kv_pages_total=10, step_timings={"forward": [0.01]},
        runner=RunnerStats(paths={"attention": "cpu"}, fallbacks={"linear": "no kernel"},
                           steps=1, shadow=ShadowStats(steps=1, tokens_agree=1,
                                                       tokens_diverge=1)),
        kv_transfer=KVTransferStats(), spec_decode=SpecDecodeCounts(accepted_per_pos=[1])))
    m.observe_request("stop", e2e_latency=1.0, ttft=0.1, num_output_tokens=3, queue_time=0.01,
                      num_prompt_tokens=4)
    out: dict[str, tuple[str, str, frozenset[str]]] = {}
    for fam in m.registry.collect():
        for s in fam.samples:
            labels = frozenset(s.labels) - {"le"}
            name, ftype, have = out.get(s.name, (fam.name, fam.type, frozenset()))
            out[s.name] = (name, ftype, have | labels)
    return out


SERIES = _series()


def _exprs() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel, rows' nested panels included."""
    dash = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out


def test_the_registry_is_read_whole() -> None:
    # the helper must see labelled families too, or the checks below would pass vacuously
    assert SERIES["radixserve:request_success_total"][2] == {"model_name", "finished_reason"}
    assert "radixserve:time_to_first_token_seconds_bucket" in SERIES
    assert SERIES["radixserve:shadow_tokens_total"][2] == {"model_name", "result"}


def test_dashboard_is_an_importable_grafana_dashboard() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36 and dash["title"] and dash["uid"]
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    assert dash["__inputs"][0]["pluginId"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
            assert p["targets"], p["title"]
    for v in dash["templating"]["list"]:
        assert v["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert set(NAME.findall(v["query"])) <= set(SERIES), v["query"]


def test_dashboard_queries_only_metrics_the_server_has() -> None:
    exprs = _exprs()
    assert exprs
    for title, expr in exprs:
        names = NAME.findall(expr)
        assert names, (title, expr)
        for name in names:
            assert name in SERIES, f"{title}: {name} is not in radixserve's registry"
            family, ftype, labels = SERIES[name]
            # a counter's rate, a histogram's buckets under histogram_quantile, a gauge as is
            if ftype == "counter":
                assert f"rate({name}" in expr, (title, name)
            elif ftype == "histogram":
                assert name.endswith("_bucket") and "histogram_quantile(" in expr, (title, name)
            else:
                assert f"rate({name}" not in expr, (title, name)
            for grouping in re.findall(r"by \(([^)]*)\)", expr):
                for label in (x.strip() for x in grouping.split(",")):
                    assert label in labels | SCRAPE_LABELS | {"le"}, (title, label)
            for label in re.findall(r"([a-z_]+)=~", expr):
                assert label in labels | SCRAPE_LABELS, (title, label)
        assert expr.count("(") == expr.count(")"), title


@pytest.mark.parametrize("metric", [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
    "prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_bucket",
    "time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
    "prefix_cache_hits_total", "prefix_cache_queries_total", "num_preemptions_total",
    "request_success_total"])
def test_dashboard_shows_the_key_series(metric: str) -> None:
    assert any("radixserve:" + metric in e for _, e in _exprs()), metric


def test_p50_and_p99_of_each_latency() -> None:
    exprs = [e for _, e in _exprs()]
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds"):
        for q in ("0.5", "0.99"):
            assert any(e.startswith(f"histogram_quantile({q},") and f"{h}_bucket" in e
                       for e in exprs), (h, q)


def test_metrics_page_lists_exactly_the_registry() -> None:
    text = METRICS_DOC.read_text()
    documented = set(NAME.findall(text))
    known = set(SERIES) | {family for family, _, _ in SERIES.values()}
    for name in documented:
        assert name in known, f"docs/metrics.md names {name}, which the server lacks"
    families: dict[str, set[str]] = {}
    for name, (family, _, _) in SERIES.items():
        if not name.endswith("_created"):
            families.setdefault(family, set()).add(name)
    for family, names in families.items():
        # a family is listed by the name a query uses: the counter's _total, the histogram's
        # own name (its _bucket/_sum/_count samples) or the gauge's
        listed = family in documented or any(n in documented for n in names)
        assert listed, f"docs/metrics.md does not list {family}"
