"""Operator settings (heron.runtime.settings): every limit and timeout of the gateway, the
worker and the config service is a flag of its command and an environment variable, the
flag wins over the variable and the variable over the default, a bad value is a config
error naming where it came from before anything starts, and docs/operations.md's reference
tables are the code's."""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import re

import pytest

from heron.config_service.settings import ConfigServiceSettings
from heron.gateway.settings import GatewaySettings
from heron.runtime.modelconfig import ConfigError
from heron.runtime.settings import Settings, WorkStreamSettings, parse_size
from heron.worker.settings import WorkerSettings
from tests.support.servers import REPO

cli = importlib.import_module("heron.cli.main")  # heron.cli.main is also the function main
OPERATIONS_MD = (REPO / "docs" / "operations.md").read_text()
COMMANDS: list[tuple[str, type[Settings]]] = [
    ("gateway", GatewaySettings), ("worker", WorkerSettings), ("config", ConfigServiceSettings)]


def _parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser().parse_args(argv)


def _documented_table(command: str) -> str:
    """The table under ``### `heron <command>``` in the settings reference."""
    section = OPERATIONS_MD.split("## Settings reference", 1)[1]
    after = section.split(f"### `heron {command}`", 1)[1]
    rows = re.search(r"^\| Flag \|.*?(?=\n\n|\n?\Z)", after, re.MULTILINE | re.DOTALL)
    assert rows, f"no table under ### `heron {command}`"
    return rows.group(0)


@pytest.mark.parametrize(("command", "cls"), COMMANDS, ids=[c for c, _ in COMMANDS])
def test_operations_md_tables_are_the_code(command: str, cls: type[Settings]) -> None:
    assert _documented_table(command) == cls.reference_table(), (
        f"docs/operations.md, ### `heron {command}`: paste this table\n\n"
        f"{cls.reference_table()}")


@pytest.mark.parametrize(("command", "cls"), COMMANDS, ids=[c for c, _ in COMMANDS])
def test_every_setting_is_a_flag_and_a_variable(command: str, cls: type[Settings]) -> None:
    parser = cli.build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]  # argparse keeps them here
    flags = {s for a in sub._actions for s in a.option_strings}
    rows = cls.reference()
    for flag, env, _default, meaning in rows:
        assert flag in flags, f"heron {command} has no {flag}"
        assert re.fullmatch(r"HERON_[A-Z0-9_]+", env), env
        assert meaning and meaning[0].isupper() and not meaning.endswith("."), meaning
    assert len({env for _, env, _, _ in rows}) == len(rows), "two settings share a variable"
    assert all(f.name in {r[0][2:].replace("-", "_") for r in rows}
               for f in cls._fields())


def test_the_gateway_has_the_fields_other_code_uses() -> None:
    s = GatewaySettings()
    assert (s.max_concurrent_requests, s.admission_min_samples, s.publish_retry_max_s) == (
        1024, 8, 10.0)
    assert s.default_timeout_s == 30.0 and s.max_outstanding_items_per_pool == 4096


def test_a_flag_wins_over_its_variable_which_wins_over_the_default() -> None:
    args = _parse(["gateway", "--default-timeout-s", "12", "--no-stream-file-storage",
                   "--max-body-bytes", "2MiB"])
    env = {"HERON_GATEWAY_DEFAULT_TIMEOUT_S": "7", "HERON_GATEWAY_PUBLISH_TIMEOUT_S": "3",
           "HERON_STREAM_FILE_STORAGE": "true", "HERON_STREAM_ACK_WAIT_S": "9",
           "HERON_GATEWAY_STARTUP_GRACE_S": ""}  # empty: unset
    s = GatewaySettings.from_args(args, env)
    assert (s.default_timeout_s, s.publish_timeout_s, s.stream_file_storage) == (12.0, 3.0,
                                                                                False)
    assert s.max_body_bytes == 2 * 1024**2 and s.stream_ack_wait_s == 9.0
    assert s.startup_grace_s == 1.5 and s.heartbeat_timeout_s == 3.0  # defaults
    spec = s.stream_spec("p")  # what the gateway declares the pool's stream with
    assert (spec.file_storage, spec.ack_wait_s, spec.pool) == (False, 9.0, "p")


def test_the_config_service_keeps_its_old_flag_name() -> None:
    assert ConfigServiceSettings.from_args(_parse(["config", "--lease-ttl", "4"]),
                                           {}).lease_ttl_s == 4.0
    assert ConfigServiceSettings.from_args(_parse(["config", "--lease-ttl-s", "3"]),
                                           {"HERON_CONFIG_LEASE_TTL_S": "9"}).lease_ttl_s == 3


BAD_VALUES = [
    (["gateway", "--default-timeout-s", "nan"], {}, "--default-timeout-s: 'nan': must be a "
                                                    "finite number"),
    (["gateway", "--default-timeout-s", "0"], {}, "must be more than 0"),
    (["gateway", "--max-concurrent-requests", "-1"], {}, "must be at least 1"),
    (["gateway", "--max-concurrent-requests", "1.5"], {}, "must be a whole number"),
    (["gateway", "--publish-retry-max-s", "inf"], {}, "must be a finite number"),
    (["gateway"], {"HERON_GATEWAY_QUEUE_FULL_RETRY_AFTER_S": "-1"},
     "HERON_GATEWAY_QUEUE_FULL_RETRY_AFTER_S: '-1': must be at least 0"),
    (["gateway"], {"HERON_GATEWAY_MAX_BODY_BYTES": "lots"}, "not a size"),
    (["gateway"], {"HERON_STREAM_FILE_STORAGE": "maybe"}, "must be true or false"),
    (["gateway"], {"HERON_STREAM_REPLICAS": "7"}, "must be at most 5"),
    (["worker", "--fetch-lookahead", "0"], {}, "--fetch-lookahead: '0': must be at least 1"),
    (["worker"], {"HERON_MEMORY_THRESHOLD_PERCENT": "150"}, "must be at most 100"),
    (["worker"], {"HERON_STREAM_MAX_DELIVER": "2.5"}, "HERON_STREAM_MAX_DELIVER"),
    (["worker", "--drain-timeout-s", "NaN"], {}, "must be a finite number"),
    (["config", "--lease-ttl-s", "0"], {}, "--lease-ttl-s: '0': must be more than 0"),
    (["config"], {"HERON_CONFIG_MAX_BODY_BYTES": "0"}, "must be at least 1"),
]


@pytest.mark.parametrize(("argv", "env", "message"), BAD_VALUES,
                         ids=[" ".join(a) + " " + " ".join(e) for a, e, _ in BAD_VALUES])
def test_a_bad_value_stops_the_command_before_it_starts(
        argv: list[str], env: dict[str, str], message: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started: list[str] = []

    def start(*args: object, **kwargs: object) -> None:
        started.append(argv[0])

    # What each command would start, had its settings been accepted.
    monkeypatch.setattr("heron.gateway.app.run", start)
    monkeypatch.setattr("heron.config_service.app.run", start)
    monkeypatch.setattr(cli, "_run_worker", lambda *a: start())
    args = _parse(argv)
    with pytest.raises(ConfigError) as caught:
        args.func(args)
    assert message in str(caught.value)
    assert started == []


def test_python_construction_checks_the_same_bounds() -> None:
    for make in (lambda: GatewaySettings(default_timeout_s=math.nan),
                 lambda: GatewaySettings(max_concurrent_requests=0),
                 lambda: GatewaySettings(startup_grace_s=-0.1),
                 lambda: WorkerSettings(fetch_lookahead=0),
                 lambda: WorkerSettings(heap_trim_s=math.inf),
                 lambda: ConfigServiceSettings(lease_ttl_s=0)):
        with pytest.raises(ConfigError):
            make()
    assert GatewaySettings(startup_grace_s=0).startup_grace_s == 0  # bounds are inclusive


def test_the_defaults_are_the_numbers_the_code_runs_with() -> None:
    """Where a setting's default also lives in the code that uses it (until that code reads
    the setting), the two agree."""
    from heron.config_service import body, service
    from heron.runtime import nats_names
    from heron.worker import consumer, memory
    from heron_sdk.types import MAX_BODY_BYTES

    gateway, worker, config = GatewaySettings(), WorkerSettings(), ConfigServiceSettings()
    assert gateway.max_items_per_work_item == nats_names.MAX_ITEMS_PER_WORK_ITEM
    assert gateway.max_tokens_per_work_item == nats_names.MAX_TOKENS_PER_WORK_ITEM
    assert WorkStreamSettings().stream_spec("p") == nats_names.WorkStreamSpec(pool="p")
    assert gateway.max_body_bytes == worker.max_body_bytes == MAX_BODY_BYTES
    assert worker.lookahead(on_gpu=False) == consumer.CPU_FETCH_LOOKAHEAD
    assert (worker.lookahead_busy(on_gpu=False), worker.lookahead_busy(on_gpu=True)) == (
        0, worker.lookahead(on_gpu=True))
    assert WorkerSettings(fetch_lookahead_busy=3).lookahead_busy(on_gpu=False) == 3
    parameters = inspect.signature(consumer.WorkConsumer).parameters
    assert worker.max_work_items_in_flight == parameters["max_in_flight"].default
    drain = inspect.signature(consumer.WorkConsumer.drain).parameters["timeout_s"].default
    assert worker.drain_timeout_s == drain
    policy = memory.MemoryPolicy()
    assert (worker.memory_threshold_percent, worker.model_memory_budget) == (
        policy.threshold_percent, policy.budget_bytes)
    assert config.max_body_bytes == body.MAX_CONFIG_BYTES
    assert config.publish_timeout_s == service.PUBLISH_TIMEOUT_S


def test_worker_flags_reach_the_code_that_reads_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`heron worker` writes its settings into its environment: the consumer, the memory
    policy, the heap trimmer and the stream declarations read them there."""
    from heron.runtime.nats_names import WorkStreamSpec, stream_replicas
    from heron.worker.memory import HeapTrimmer, MemoryPolicy

    for f in WorkerSettings._fields():
        monkeypatch.setenv(f.env, "")  # recorded: restored, or removed, after the test
        monkeypatch.delenv(f.env)
    args = _parse(["worker", "--fetch-lookahead", "7", "--memory-threshold-percent", "70",
                   "--model-memory-budget", "1.5GiB", "--idle-evict-s", "30",
                   "--heap-trim-s", "2", "--stream-replicas", "3"])
    settings = WorkerSettings.from_args(args, {})
    settings.export_env()
    assert WorkerSettings.from_env().lookahead(on_gpu=False) == 7
    assert MemoryPolicy.from_env() == MemoryPolicy(threshold_percent=70.0,
                                                   budget_bytes=int(1.5 * 1024**3),
                                                   idle_evict_s=30.0)
    assert HeapTrimmer().every_s == 2.0
    assert stream_replicas() == 3 and WorkStreamSpec(pool="p").replicas == 3
    assert WorkerSettings.from_env() == settings  # what export wrote reads back the same
    # auto (None) is no variable at all: the reader falls back to its device default.
    WorkerSettings(fetch_lookahead=None).export_env()
    assert "HERON_FETCH_LOOKAHEAD" not in os.environ
    assert WorkerSettings.from_env().lookahead(on_gpu=False) == WorkerSettings().lookahead(
        on_gpu=False)


def test_export_and_read_back_every_kind_of_value() -> None:
    settings = GatewaySettings(default_timeout_s=0.1 + 0.2, stream_file_storage=False,
                               max_body_bytes=12345, stream_replicas=3)
    environ: dict[str, str] = {"HERON_GATEWAY_UNRELATED": "x"}
    settings.export_env(environ)
    assert GatewaySettings.from_env(environ) == settings  # floats keep every digit
    assert environ["HERON_STREAM_FILE_STORAGE"] == "false"


def test_stream_replicas_keeps_reading_the_environment_in_python(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GatewaySettings() and WorkerSettings() built in Python take HERON_STREAM_REPLICAS,
    as before (in-process gateways on a 3-node cluster rely on it); nothing else."""
    monkeypatch.setenv("HERON_STREAM_REPLICAS", "3")
    monkeypatch.setenv("HERON_GATEWAY_DEFAULT_TIMEOUT_S", "5")
    assert GatewaySettings().stream_replicas == 3 == WorkerSettings().stream_replicas
    assert GatewaySettings().default_timeout_s == 30.0
    assert list(GatewaySettings().changed()) == [("stream_replicas", 3)]


@pytest.mark.parametrize(("text", "size"), [("123456", 123456), ("800MB", 800_000_000),
                                            ("16MiB", 16 * 1024**2), ("1.5GiB", 1610612736),
                                            (" 2 kib ", 2048)])
def test_sizes_read_with_units(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("command", [c for c, _ in COMMANDS])
def test_help_lists_every_setting_with_its_variable(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        _parse([command, "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    cls = dict(COMMANDS)[command]
    for flag, env, _default, _meaning in cls.reference():
        assert flag in text and env in text, flag
