"""The settings deploy/k8s gives Heron's processes: every HERON_* variable a manifest sets is
one the code reads, each setting's value is accepted by the command that runs there, the
work stream settings agree between the gateway and every pool, and each pod's grace period
covers the shutdown its settings allow."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path
from typing import Any

import pytest

from heron.config_service.settings import ConfigServiceSettings
from heron.gateway.settings import GatewaySettings
from heron.runtime.settings import Settings, WorkStreamSettings
from heron.worker.settings import WorkerSettings

from .manifests import OVERLAYS, ROOT, by_kind, env_of, image_argv, render

cli = importlib.import_module("heron.cli.main")
SETTINGS: dict[str, type[Settings]] = {"gateway": GatewaySettings, "worker": WorkerSettings,
                                       "config": ConfigServiceSettings}
SOURCES = ("heron", "gateway", "worker", "config_service")


def _variables_the_code_reads() -> set[str]:
    names: set[str] = set()
    for folder in SOURCES:
        for path in Path(ROOT, folder).rglob("*.py"):
            names |= set(re.findall(r"HERON_[A-Z0-9_]+", path.read_text()))
    for cls in SETTINGS.values():
        names |= {env for _, env, _, _ in cls.reference()}
    return names


def _processes(overlay: str) -> list[tuple[str, dict[str, Any], argparse.Namespace,
                                            dict[str, Any]]]:
    """(name, pod spec, parsed `heron` arguments, env) of every Heron container."""
    argv_of, out = image_argv(), []
    for kind in ("Deployment", "StatefulSet"):
        for name, doc in by_kind(render(overlay), kind).items():
            pod = doc["spec"]["template"]["spec"]
            for container in pod["containers"]:
                if "heron-" not in container["image"]:
                    continue
                image = container["image"].rsplit("/", 1)[-1].split(":")[0]
                base = max((k for k in argv_of if image.startswith(k)), key=len)
                if base == "heron-control":  # ENTRYPOINT heron; args replace CMD
                    argv = ["heron", *container.get("args", ["gateway"])]
                else:
                    argv = argv_of[base] + container.get("args", [])
                out.append((name, pod, cli.build_parser().parse_args(argv[1:]),
                            env_of(container)))
    return out


def _literal(env: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in env.items() if isinstance(v, str)}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_heron_variable_is_read_and_every_setting_accepted(overlay: str) -> None:
    known = _variables_the_code_reads()
    processes = _processes(overlay)
    assert {args.command for _, _, args, _ in processes} == set(SETTINGS)
    for name, _pod, args, env in processes:
        unknown = {k for k in env if k.startswith("HERON_")} - known
        assert not unknown, f"{name}: no code reads {sorted(unknown)} (a typo?)"
        SETTINGS[args.command].from_args(args, _literal(env))  # ConfigError if refused


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_and_workers_declare_the_same_work_streams(overlay: str) -> None:
    specs = {name: WorkStreamSettings.from_env(_literal(env)).stream_spec("p")
             for name, _, args, env in _processes(overlay)
             if args.command in ("gateway", "worker")}
    assert len(specs) >= 2 and len(set(specs.values())) == 1, specs


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pod_has_time_for_the_shutdown_its_settings_allow(overlay: str) -> None:
    for name, pod, args, env in _processes(overlay):
        grace = pod["terminationGracePeriodSeconds"]
        settings = SETTINGS[args.command].from_args(args, _literal(env))
        if isinstance(settings, GatewaySettings):
            container = next(c for c in pod["containers"] if "heron-" in c["image"])
            pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
            assert grace >= pre_stop + settings.shutdown_timeout_s, name
        elif isinstance(settings, WorkerSettings):
            # uvicorn finishes HTTP requests first, then the consumer drains.
            http_s = cli._uvicorn_options(argparse.Namespace(
                host="0.0.0.0", port=8081, log_level="info", access_log=False)
            )["timeout_graceful_shutdown"]
            assert grace > http_s + settings.drain_timeout_s, name
