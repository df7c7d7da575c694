"""Build Heron's Grafana dashboards (JSON, schema 39) from the panel lists below.

    python deploy/grafana/generate.py        # rewrites deploy/grafana/dashboards/*.json
                                             # and their copies in deploy/k8s/base

Every query names only metrics the gateway, workers and config service export
(docs/metrics.md); tests/integration/test_dashboards.py checks that against live
/metrics. Each dashboard takes its Prometheus data source from the ``datasource``
variable, so it imports into any Grafana (UI import, provisioning, or the Grafana
operator's GrafanaDashboard resource).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("dashboards")
# Kustomize reads no file above its own folder: the k8s base ships a copy of each board.
K8S_COPY = Path(__file__).resolve().parents[1] / "k8s" / "base" / "monitoring" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

# (title, unit, [(PromQL, legend)]) per panel; two panels per row.
Panel = tuple[str, str, list[tuple[str, str]]]


def p99(metric: str, by: str) -> str:
    return (f"histogram_quantile(0.99, sum by (le, {by}) "
            f"(rate({metric}_bucket[$__rate_interval])))")


def mean(metric: str, by: str) -> str:
    return (f"sum by ({by}) (rate({metric}_sum[$__rate_interval])) / "
            f"sum by ({by}) (rate({metric}_count[$__rate_interval]))")


CLUSTER: list[Panel] = [
    ("Gateway requests by route and status", "reqps",
     [("sum by (route, status) (rate(heron_gateway_requests_total[$__rate_interval]))",
       "{{route}} {{status}}")]),
    ("Gateway latency p99 by route", "s",
     [(p99("heron_gateway_request_duration_seconds", "route"), "{{route}}")]),
    ("Gateway phases p99", "s",
     [(p99("heron_gateway_phase_duration_seconds", "phase"), "{{phase}}")]),
    ("Pending demand per pool (KEDA scales on this)", "short",
     [("sum by (pool) (heron_gateway_pending_demand)", "{{pool}}")]),
    ("Healthy workers per pool", "short",
     [("max by (pool) (heron_gateway_healthy_workers)", "{{pool}}")]),
    ("Items published and not answered, per pool", "short",
     [("sum by (pool) (heron_gateway_outstanding_items)", "{{pool}}")]),
    ("Work items published per pool", "ops",
     [("sum by (pool) (rate(heron_gateway_work_items_published_total[$__rate_interval]))",
       "{{pool}}")]),
    ("Results ignored (duplicates from redelivery, late, malformed)", "ops",
     [("sum by (reason) (rate(heron_gateway_results_ignored_total[$__rate_interval]))",
       "{{reason}}")]),
    ("Connected to NATS", "short",
     [("min(heron_gateway_nats_connected)", "gateways (min)"),
      ("min(heron_config_nats_connected)", "config service (min)")]),
    ("Config epoch: service, gateways, workers (converged when equal)", "short",
     [("max(heron_config_epoch)", "config service"),
      ("min(heron_gateway_config_epoch)", "gateways (min)"),
      ("min(heron_worker_config_epoch)", "workers (min)"),
      ("sum(heron_config_is_leader)", "config leaders (must be 1)")]),
    ("JetStream redeliveries and dead letters", "ops",
     [("sum by (pool) (rate(heron_worker_redeliveries_total[$__rate_interval]))",
       "redelivered {{pool}}"),
      ("sum by (pool) (rate(heron_worker_dead_letters_total[$__rate_interval]))",
       "dead-lettered {{pool}}")]),
    ("Config posts and publish errors", "ops",
     [("sum by (status) (rate(heron_config_posts_total[$__rate_interval]))", "posts {{status}}"),
      ("sum(rate(heron_config_publish_errors_total[$__rate_interval]))", "publish errors")]),
]

WORKERS: list[Panel] = [
    ("Items computed per model", "ops",
     [("sum by (model) (rate(heron_worker_items_total[$__rate_interval]))", "{{model}}")]),
    ("Worker requests by route and status", "reqps",
     [("sum by (route, status) (rate(heron_worker_requests_total[$__rate_interval]))",
       "{{route}} {{status}}")]),
    ("Worker phases p99 (tokenize, batch wait, inference, postprocess)", "s",
     [(p99("heron_worker_phase_duration_seconds", "phase"), "{{phase}}")]),
    ("Forward pass per batch p99", "s",
     [(p99("heron_worker_batch_inference_seconds", "model"), "{{model}}")]),
    ("Mean items per batch", "short",
     [(mean("heron_worker_batch_items", "model"), "{{model}}")]),
    ("Mean padded tokens per batch, and padding ratio", "short",
     [(mean("heron_worker_batch_padded_tokens", "model"), "tokens {{model}}"),
      (mean("heron_worker_batch_padding_ratio", "model"), "padded/real {{model}}")]),
    ("Queued items per model", "short",
     [("sum by (model) (heron_worker_queue_items)", "{{model}}")]),
    ("Models loaded and their memory", "bytes",
     [("sum(heron_worker_model_memory_bytes)", "weights and buffers"),
      ("sum(heron_worker_models_loaded)", "models loaded (all workers)")]),
    ("Worker process memory (RSS)", "bytes",
     [("sum(heron_worker_resident_memory_bytes)", "all workers"),
      ("max(heron_worker_resident_memory_bytes)", "largest")]),
    ("Model loads by result", "ops",
     [("sum by (result) (rate(heron_worker_model_loads_total[$__rate_interval]))",
       "{{result}}")]),
    ("Evictions by reason", "ops",
     [("sum by (reason) (rate(heron_worker_model_evictions_total[$__rate_interval]))",
       "{{reason}}")]),
    ("Weight cache by tier", "ops",
     [("sum by (tier) (rate(heron_worker_weight_cache_hits_total[$__rate_interval]))",
       "hits {{tier}}"),
      ("sum by (tier) (rate(heron_worker_weight_cache_misses_total[$__rate_interval]))",
       "misses {{tier}}")]),
]


def dashboard(uid: str, title: str, panels: list[Panel]) -> dict[str, Any]:
    out = []
    for i, (panel_title, unit, targets) in enumerate(panels):
        out.append({
            "id": i + 1, "type": "timeseries", "title": panel_title, "datasource": DATASOURCE,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                        "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "datasource": DATASOURCE, "expr": expr,
                         "legendFormat": legend} for j, (expr, legend) in enumerate(targets)],
        })
    return {
        "uid": uid, "title": title, "tags": ["heron"], "schemaVersion": 39, "version": 1,
        "editable": True, "timezone": "browser", "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "label": "Prometheus",
                                 "type": "datasource", "query": "prometheus"}]},
        "panels": out,
    }


DASHBOARDS = {
    "heron-cluster.json": dashboard("heron-cluster", "Heron: cluster", CLUSTER),
    "heron-workers.json": dashboard("heron-workers", "Heron: workers", WORKERS),
}


def main() -> None:
    for folder in (OUT, K8S_COPY):
        folder.mkdir(parents=True, exist_ok=True)
        for name, board in DASHBOARDS.items():
            (folder / name).write_text(json.dumps(board, indent=2) + "\n")
            print(f"wrote {folder / name}")


if __name__ == "__main__":
    main()
