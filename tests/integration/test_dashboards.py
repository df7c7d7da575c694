"""The Grafana dashboards under deploy/grafana query only metrics Heron exports."""

from __future__ import annotations

import importlib.util
import json
import re

from tests.support import local_http
from tests.support.cluster_procs import ConfigProcess
from tests.support.servers import REPO

GRAFANA = REPO / "deploy" / "grafana"
METRIC = re.compile(r"\b(heron_[a-z0-9_]+)")


def load_generator():  # deploy/ is not a package: load the script as a module
    spec = importlib.util.spec_from_file_location("grafana_generate", GRAFANA / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exported_names(text: str) -> set[str]:
    """Every series name a /metrics page shows, with histogram and counter suffixes."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            names |= {name, name + "_total", name + "_bucket", name + "_sum", name + "_count"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_dashboards_are_generated_and_well_formed() -> None:
    generator = load_generator()
    for name, board in generator.DASHBOARDS.items():
        on_disk = json.loads((GRAFANA / "dashboards" / name).read_text())
        assert on_disk == board, f"{name} is stale: run python deploy/grafana/generate.py"
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)) and board["uid"]
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])


def test_every_queried_metric_is_exported(cluster_url: str, base_url: str,
                                          config_service: ConfigProcess) -> None:
    # One request each way, so labelled series exist too.
    for url in (cluster_url, base_url):
        assert local_http.post(f"{url}/v1/encode/minilm", json={"items": ["dashboards"]},
                               timeout=30).status_code == 200
    exported: set[str] = set()
    for url in (cluster_url, base_url, config_service.url):
        exported |= exported_names(local_http.get(f"{url}/metrics", timeout=10).text)
    queried = {name for board in load_generator().DASHBOARDS.values()
               for panel in board["panels"] for target in panel["targets"]
               for name in METRIC.findall(target["expr"])}
    assert queried, "no metric found in the dashboards"
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"
