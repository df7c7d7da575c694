"""Bulk jobs against interactive traffic on the same cluster: how fast a job runs alone, and
what a running job does to interactive latency.

    python -m bench.job_bench [--quick] [--rounds N] [--duration S] [--job-seconds S]
                              [--bundle default|null] [--workers auto|N] [--split-cores]
                              [--shards-in-flight N] [--shard-rows N] [--no-plot] [--out DIR]

``heron up`` (default bundle, MiniLM, real compute; ``--bundle null``: real tokenization,
no model compute) runs on free loopback ports with its data dir in a temporary folder (the
one place ``heron up`` lets jobs read and write), with ``--workers`` workers (default: as
many as ``heron serve --workers auto`` runs, the CPUs split between them; ``--split-cores``:
one worker whose inference has CPU 0 to itself, everything else on the others, the layout
of bench/cluster_bench.py --split-cores). Each round has
two pairs of steps; their order alternates from round to round, so a drift of the
machine's speed cancels in the medians:

1. Throughput. ``interactive``: wrk, ``--saturate-clients`` (32) closed-loop connections
   of single-text ``POST /v1/encode/<model>`` requests for ``--duration`` seconds:
   items/s (one text per request, as clients send them; the gateway may coalesce them into
   shared work items, while a job's shard goes as work items of up to 64 rows, so the
   ratio can exceed 1). ``job_alone``: a JSONL of as many rows as that rate computes in
   ``--job-seconds``, ``POST /v1/jobs`` (parquet out), polled until it succeeds; rows/s
   is rows over the record's ``finished_at - created_at`` (the whole job: reading the
   input, every shard, writing the output). The ratio job / interactive: target >= 0.90.
2. Latency. ``--latency-clients`` (8) wrk connections of single-text requests for
   ``--duration`` seconds, without a job, then with one: a job too big to end within the
   step is created and the step starts once it has finished a shard; after the step the
   job is cancelled (``DELETE``) and the pool left to drain its last shards. p99 with /
   without: target <= 1.10. The job's rows/s during the step says whether the job still
   advances under that load (no starvation).

Each wrk step also records, from the gateway's phase histogram (interactive requests only;
jobs' shards are not in it), the mean time its requests spent per phase
(``mean_phase_ms``: ``queue_wait`` in the work stream before a worker fetched the item,
``batch_wait`` in the worker's batcher, ``inference``...) and how many were answered with
results (``answered_with_results``: a 202 from a pool that looks cold is a 2xx that
computed nothing); the summary has the phases' medians without and with a job.

Every text is sent once in the whole run (a base of bench/texts.py's mixed 8-128-token
texts, each pass over it tagged with its pass number): the worker's result cache and
in-flight dedup never answer a request, and jobs and interactive requests draw from the
same length distribution. wrk drives the load (one thread; see bench/README.md, "Why
wrk"); its latency percentiles are per request.

Prints one JSON document and writes DIR/job_bench.json, and DIR/job_bench.png when
matplotlib is installed (DIR: bench/results/). ``--quick``: 1 round of 4 s steps and a
10 s job, for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cluster_bench import local_cluster
from bench.load import run_wrk, write_bodies
from bench.server import REPO, http
from bench.texts import build_workload
from heron.cli.main import serve_processes, threads_per_process

MODELS = {"default": "minilm", "null": "null-model"}
THROUGHPUT_TARGET = 0.90  # job rows/s over saturated interactive items/s, at least
LATENCY_TARGET = 1.10  # interactive p99 with a job over without, at most
FINISHED = ("succeeded", "failed", "cancelled")
POLL_S = 0.25
OUTSTANDING = re.compile(r"^heron_gateway_outstanding_items(?:\{[^}]*\})? (\S+)$")
# Interactive requests' phases (bulk jobs' shards are not counted in it: gateway/routes.py)
PHASE = re.compile(r'^heron_gateway_phase_duration_seconds_(sum|count)'
                   r'\{[^}]*phase="(\w+)"[^}]*\} (\S+)$')


def log(message: str) -> None:
    print(f"[job_bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class FreshTexts:
    """Texts never sent before in this run: the base texts, each pass tagged."""

    base: list[str]
    taken: int = 0

    def take(self, n: int) -> list[str]:
        out = []
        for k in range(self.taken, self.taken + n):
            rounds, i = divmod(k, len(self.base))
            out.append(f"{self.base[i]} (pass {rounds})")
        self.taken += n
        return out


@dataclass
class Bench:
    gateway: str
    model: str
    data_dir: Path
    texts: FreshTexts
    duration: float
    saturate_clients: int
    latency_clients: int
    rate_guess: float  # items/s the cluster computes, the best seen so far
    job_rate: float = 0.0  # the best rows/s of a job alone
    steps: int = 0
    warnings: list[str] = field(default_factory=list)
    cpus: set[int] | None = None  # where wrk runs (--split-cores: off the worker's CPU)

    # ---- interactive ---------------------------------------------------------------------
    def wrk_step(self, clients: int, duration: float, warm_up: bool = False
                 ) -> dict[str, Any]:
        """One wrk step on texts of its own (more than it can send: no text twice)."""
        self.steps += 1
        n = max(2000, int(self.rate_guess * duration * 2))
        bodies = self.data_dir / f"bodies-{self.steps}.jsonl"
        write_bodies(self.texts.take(n), bodies)
        before = self.phase_totals()
        result = run_wrk(f"{self.gateway}/v1/encode/{self.model}", bodies,
                         connections=clients, duration_s=duration, cpus=self.cpus).summary()
        after = self.phase_totals()
        bodies.unlink()
        phases, computed = {}, 0
        for phase, (seconds, count) in after.items():
            seconds0, count0 = before.get(phase, [0.0, 0.0])
            if count > count0:
                phases[phase] = round((seconds - seconds0) / (count - count0) * 1000, 2)
                computed = max(computed, int(count - count0))
        # Where the time went, as the gateway saw it (queue_wait: in the work stream before
        # a worker fetched the item; batch_wait: in the worker's batcher).
        result["mean_phase_ms"] = phases
        # Requests answered with results (a 202 while a pool looks cold is a fast 2xx that
        # computed nothing); wrk counts the ones still in flight at its end as well.
        result["answered_with_results"] = computed
        if computed < 0.97 * result["requests"] - clients and not warm_up:
            self.warn(f"wrk step {self.steps}: {result['requests']} requests, only "
                      f"{computed} answered with results")
        if result["requests"] > n and not warm_up:
            self.warn(f"wrk step {self.steps} sent {result['requests']} requests from {n} "
                      "bodies: texts repeated (cache hits possible)")
        answered = min(computed, result["requests"] - result["non_2xx"]) \
            / max(result["duration_s"], 1e-9)
        self.rate_guess = max(self.rate_guess, answered)  # a fast error is no rate
        if result["non_2xx"] and not warm_up:
            self.warn(f"wrk step {self.steps}: {result['non_2xx']} answers were not 2xx")
        return result

    def warn(self, message: str) -> None:
        log(f"warning: {message}")
        self.warnings.append(message)

    # ---- jobs ----------------------------------------------------------------------------
    def create_job(self, rows: int) -> tuple[str, Path, float]:
        """(job id, output path, monotonic time of the POST) of a new job of ``rows`` fresh
        texts."""
        self.steps += 1
        source = self.data_dir / f"job-{self.steps}.jsonl"
        output = self.data_dir / f"job-{self.steps}.parquet"
        source.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n"
                                  for i, t in enumerate(self.texts.take(rows))))
        body = {"model": self.model,
                "input": {"uri": f"file://{source}", "format": "jsonl", "id_field": "id"},
                "output": {"uri": f"file://{output}", "format": "parquet"}}
        posted = time.monotonic()
        status, answer = http("POST", f"{self.gateway}/v1/jobs", body)
        if status != 202 or not isinstance(answer, dict):
            raise RuntimeError(f"POST /v1/jobs: {status} {answer}")
        return str(answer["id"]), output, posted

    def wait_healthy(self, workers: int, timeout_s: float = 120.0) -> None:
        """Until the gateway counts ``workers`` healthy workers in the model's pool: before,
        it may answer 202 (pool provisioning) where a measurement expects results."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status, ready = http("GET", f"{self.gateway}/readyz", timeout=5.0)
            pools = ready.get("pools", {}) if isinstance(ready, dict) else {}
            if status == 200 and any(p.get("healthy_workers", 0) >= workers
                                     for p in pools.values() if isinstance(p, dict)):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the gateway does not see {workers} healthy workers: {ready}")

    def job(self, job_id: str) -> dict[str, Any]:
        status, answer = http("GET", f"{self.gateway}/v1/jobs/{job_id}", timeout=10.0)
        if status != 200 or not isinstance(answer, dict):
            raise RuntimeError(f"GET /v1/jobs/{job_id}: {status} {answer}")
        return answer

    def wait_job(self, job_id: str, timeout_s: float,
                 until: Callable[[dict[str, Any]], bool]) -> tuple[dict[str, Any], float]:
        """Poll until ``until(record)``; (the record, monotonic time it was seen)."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if until(info):
                return info, time.monotonic()
            if info["state"] in FINISHED:
                raise RuntimeError(f"job {job_id} ended ({info['state']}) early: {info}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} not done in {timeout_s:.0f} s: {info}")
            time.sleep(POLL_S)

    def job_alone(self, seconds: float) -> dict[str, Any]:
        """A job sized to take about ``seconds`` at the interactive rate, to its end."""
        rows = max(512, int(self.rate_guess * seconds))
        job_id, output, posted = self.create_job(rows)
        info, seen = self.wait_job(job_id, max(300.0, seconds * 20),
                                   lambda i: i["state"] in FINISHED)
        if info["state"] != "succeeded":
            raise RuntimeError(f"job {job_id} {info['state']}: {info}")
        output.unlink(missing_ok=True)
        span = info["finished_at"] - info["created_at"]
        run = info["finished_at"] - info["started_at"]
        self.job_rate = max(self.job_rate, rows / span)
        return {"job": job_id, "rows": rows, "rows_failed": info["rows_failed"],
                "seconds": round(span, 2), "rows_per_s": round(rows / span, 1),
                "seconds_from_claim": round(run, 2),
                "claim_delay_s": round(info["started_at"] - info["created_at"], 2),
                "record_rows_per_s": info["rows_per_s"],  # the runner's, up to its last shard
                "client_seconds": round(seen - posted, 2),
                "shards": info["shards_total"], "runs": info["runs"]}

    def outstanding(self) -> float | None:
        """The gateway's items published and not answered yet, all pools."""
        status, text = http("GET", f"{self.gateway}/metrics", timeout=10.0)
        if status != 200 or not isinstance(text, str):
            return None
        return sum(float(m.group(1)) for m in map(OUTSTANDING.match, text.splitlines()) if m)

    def phase_totals(self) -> dict[str, list[float]]:
        """phase -> [seconds, requests] of the gateway's phase histogram, all models."""
        status, text = http("GET", f"{self.gateway}/metrics", timeout=10.0)
        totals: dict[str, list[float]] = {}
        if status == 200 and isinstance(text, str):
            for match in map(PHASE.match, text.splitlines()):
                if match:
                    pair = totals.setdefault(match.group(2), [0.0, 0.0])
                    pair[match.group(1) == "count"] += float(match.group(3))
        return totals

    def cancel(self, job_id: str, drain_s: float) -> dict[str, Any]:
        status, _ = http("DELETE", f"{self.gateway}/v1/jobs/{job_id}")
        if status not in (200, 202):
            raise RuntimeError(f"DELETE /v1/jobs/{job_id}: {status}")
        info, _ = self.wait_job(job_id, 60.0, lambda i: i["state"] in FINISHED)
        # The run stops within a few seconds; its shards in flight stay in the work stream
        # and are computed anyway (their results ignored). Let them drain before the next
        # step, or it would measure them.
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and (self.outstanding() or 0) > 0:
            time.sleep(POLL_S)
        time.sleep(drain_s)
        return info

    def latency(self, with_job: bool, job_rows: int, drain_s: float) -> dict[str, Any]:
        """``latency_clients`` wrk connections, without a job or with one running."""
        if not with_job:
            return {"wrk": self.wrk_step(self.latency_clients, self.duration)}
        job_id, output, _ = self.create_job(job_rows)
        started, _ = self.wait_job(job_id, 120.0, lambda i: i["rows_done"] > 0)
        t0 = time.monotonic()
        wrk = self.wrk_step(self.latency_clients, self.duration)
        after = self.job(job_id)
        span = time.monotonic() - t0
        done = after["rows_done"] - started["rows_done"]
        if after["state"] != "running" or after["rows_done"] >= after["rows_total"]:
            self.warn(f"job {job_id} ended before the latency step did ({after['state']}): "
                      "make it bigger (--job-seconds)")
        cancelled = self.cancel(job_id, drain_s)
        output.unlink(missing_ok=True)
        return {"wrk": wrk, "job": {
            "job": job_id, "rows": job_rows, "rows_done_in_step": done,
            "rows_per_s_in_step": round(done / span, 1),
            "still_running_after_step": after["state"] == "running",
            "state_after_cancel": cancelled["state"]}}


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds = 1 if args.quick else args.rounds
    duration = 4.0 if args.quick else args.duration
    job_seconds = 10.0 if args.quick else args.job_seconds
    workers = serve_processes(args.workers, "auto")
    threads = 0 if workers == 1 else threads_per_process(workers)
    other_cpus = inference_cpus = None
    layout = f"{workers} worker(s), every process on every CPU"
    if args.split_cores:  # as bench/cluster_bench.py --split-cores: deploy/k8s, scaled down
        usable = os.sched_getaffinity(0)
        if len(usable) < 2:
            raise SystemExit("job_bench --split-cores needs at least 2 usable CPUs")
        workers, threads, inference_cpus = 1, 1, {min(usable)}
        other_cpus = usable - inference_cpus
        layout = (f"split cores: 1 worker with 1 torch thread, its inference on CPU "
                  f"{min(usable)}; nats-server, config service, gateway, the worker's "
                  f"event loop and wrk on CPUs {sorted(other_cpus)}")
    model = args.model or MODELS.get(args.bundle, "minilm")
    extra_env = {}
    if args.shards_in_flight:
        extra_env["HERON_GATEWAY_JOB_SHARDS_IN_FLIGHT"] = str(args.shards_in_flight)
    if args.shard_rows:
        extra_env["HERON_GATEWAY_JOB_SHARD_ROWS"] = str(args.shard_rows)
    base = build_workload(512 if args.quick else 2048)
    report: dict[str, Any] = {
        "benchmark": "job_bench", "mode": "quick" if args.quick else "full",
        "bundle": args.bundle, "model": model, "cpu_count": os.cpu_count(),
        "workers": workers, "threads_per_worker": threads or "torch default",
        "layout": layout,
        "job_settings": extra_env or "as shipped",
        "rounds": rounds, "duration_s": duration, "job_seconds": job_seconds,
        "saturate_clients": args.saturate_clients, "latency_clients": args.latency_clients,
        "requests": "one text per request", "job_format": "jsonl in, parquet out",
        "workload": {**base.stats(), "note": "each text tagged ' (pass N)': sent once"},
        "targets": {"job_to_interactive_at_least": THROUGHPUT_TARGET,
                    "p99_with_job_to_without_at_most": LATENCY_TARGET}}
    throughput: list[dict[str, Any]] = []
    latency: list[dict[str, Any]] = []
    warnings: list[str] = []
    with tempfile.TemporaryDirectory(prefix="heron-job-bench-") as tmp:
        data_dir = Path(tmp) / "up"
        log(f"heron up --bundle {args.bundle}: {workers} worker(s)")
        with local_cluster(args.bundle, data_dir, workers, threads, other_cpus=other_cpus,
                           inference_cpus=inference_cpus, extra_env=extra_env) as (gateway, _):
            bench = Bench(gateway, model, data_dir.resolve(), FreshTexts(base.texts),
                          duration, args.saturate_clients, args.latency_clients,
                          rate_guess=50.0, warnings=warnings, cpus=other_cpus)
            bench.wait_healthy(workers)
            log("warm-up: interactive, then a small job")
            report["warm_up"] = {
                "interactive": [bench.wrk_step(c, 3.0, warm_up=True)["throughput_rps"]
                                for c in (args.latency_clients, args.saturate_clients)],
                "job": bench.job_alone(1.0)}
            for r in range(rounds):
                order = ("interactive", "job_alone") if r % 2 == 0 else \
                    ("job_alone", "interactive")
                row: dict[str, Any] = {"round": r, "order": list(order)}
                for name in order:
                    row[name] = (bench.wrk_step(args.saturate_clients, duration)
                                 if name == "interactive" else bench.job_alone(job_seconds))
                items = row["interactive"]["throughput_rps"]
                row["ratio"] = round(row["job_alone"]["rows_per_s"] / items, 3)
                log(f"round {r}: interactive {items}/s at {args.saturate_clients} clients, "
                    f"job alone {row['job_alone']['rows_per_s']} rows/s "
                    f"({row['job_alone']['rows']} rows): {row['ratio']:.1%}")
                throughput.append(row)

                # Big enough to outlast its first shard and the step at its rate alone.
                top = max(bench.job_rate, bench.rate_guess)
                job_rows = int(top * (duration + 10) * 1.5)
                drain_s = 1.0 + 2 * 512 / top  # ~ two shards of 256 rows
                sides = (False, True) if r % 2 == 0 else (True, False)
                lat: dict[str, Any] = {"round": r, "order": [
                    "with_job" if s else "without_job" for s in sides]}
                for with_job in sides:
                    lat["with_job" if with_job else "without_job"] = bench.latency(
                        with_job, job_rows, drain_s)
                off, on = lat["without_job"]["wrk"], lat["with_job"]["wrk"]
                lat["p99_ratio"] = round(on["latency_ms"]["p99"]
                                         / max(off["latency_ms"]["p99"], 1e-9), 3)
                lat["p50_ratio"] = round(on["latency_ms"]["p50"]
                                         / max(off["latency_ms"]["p50"], 1e-9), 3)
                lat["items_per_s_ratio"] = round(on["throughput_rps"]
                                                 / max(off["throughput_rps"], 1e-9), 3)
                log(f"round {r}: {args.latency_clients} clients p50/p99 "
                    f"{off['latency_ms']['p50']}/{off['latency_ms']['p99']} ms without a job, "
                    f"{on['latency_ms']['p50']}/{on['latency_ms']['p99']} ms with one "
                    f"(p99 x{lat['p99_ratio']}); the job did "
                    f"{lat['with_job']['job']['rows_per_s_in_step']} rows/s meanwhile; mean "
                    f"phases (ms) without {off['mean_phase_ms']}, with {on['mean_phase_ms']}")
                latency.append(lat)
    ratio = median([r["ratio"] for r in throughput])
    p99_ratio = median([r["p99_ratio"] for r in latency])
    report["summary"] = {
        "interactive_items_per_s": median([r["interactive"]["throughput_rps"]
                                           for r in throughput]),
        "job_rows_per_s": median([r["job_alone"]["rows_per_s"] for r in throughput]),
        "job_to_interactive": ratio,
        "job_to_interactive_ok": ratio is not None and ratio >= THROUGHPUT_TARGET,
        "p50_ms_without_job": median([r["without_job"]["wrk"]["latency_ms"]["p50"]
                                      for r in latency]),
        "p99_ms_without_job": median([r["without_job"]["wrk"]["latency_ms"]["p99"]
                                      for r in latency]),
        "p50_ms_with_job": median([r["with_job"]["wrk"]["latency_ms"]["p50"]
                                   for r in latency]),
        "p99_ms_with_job": median([r["with_job"]["wrk"]["latency_ms"]["p99"]
                                   for r in latency]),
        "p99_with_to_without": p99_ratio,
        "p99_ok": p99_ratio is not None and p99_ratio <= LATENCY_TARGET,
        "job_rows_per_s_under_latency_load": median([
            r["with_job"]["job"]["rows_per_s_in_step"] for r in latency]),
        "items_per_s_with_to_without": median([r["items_per_s_ratio"] for r in latency]),
    }
    for side in ("without_job", "with_job"):
        phases = {p for r in latency for p in r[side]["wrk"]["mean_phase_ms"]}
        report["summary"][f"mean_phase_ms_{side}"] = {
            p: median([r[side]["wrk"]["mean_phase_ms"][p] for r in latency
                       if p in r[side]["wrk"]["mean_phase_ms"]]) for p in sorted(phases)}
    report["throughput"] = throughput
    report["latency"] = latency
    report["warnings"] = warnings
    return report


def plot(result: dict[str, Any], path: Path) -> bool:
    """The figure; False (and nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    throughput, latency = result["throughput"], result["latency"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = list(range(len(throughput)))
    width = 0.38
    left.bar([x - width / 2 for x in xs], [r["interactive"]["throughput_rps"]
                                           for r in throughput], width,
             label=f"interactive, {result['saturate_clients']} clients (items/s)")
    left.bar([x + width / 2 for x in xs], [r["job_alone"]["rows_per_s"] for r in throughput],
             width, label="job alone (rows/s)")
    for x, r in zip(xs, throughput, strict=True):
        left.annotate(f"{r['ratio']:.0%}", (x + width / 2, r["job_alone"]["rows_per_s"]),
                      ha="center", va="bottom", fontsize=9)
    top = max(max(r["interactive"]["throughput_rps"], r["job_alone"]["rows_per_s"])
              for r in throughput)
    left.set(xlabel="round", ylabel="items / s", title="Throughput", ylim=(0, top * 1.3))
    left.set_xticks(xs, [str(x) for x in xs])
    names = ("without_job", "with_job")
    for k, name in enumerate(names):
        for q, style in (("p50", "o"), ("p99", "s")):
            right.plot([x + (k - 0.5) * 0.2 for x in xs],
                       [r[name]["wrk"]["latency_ms"][q] for r in latency], style,
                       color=f"C{k}", fillstyle="full" if q == "p99" else "none",
                       label=f"{q} {name.replace('_', ' ')}")
    right.set(xlabel="round", ylabel="latency (ms)", ylim=(0, None),
              title=f"Interactive latency, {result['latency_clients']} clients")
    right.set_xticks(xs, [str(x) for x in xs])
    right.set_xlim(-0.5, len(xs) - 0.5)
    for ax in (left, right):
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    s = result["summary"]
    fig.suptitle(f"Heron bulk jobs, {result['model']}, {result['workers']} worker(s), "
                 f"{result['cpu_count']} CPUs: job/interactive {s['job_to_interactive']}, "
                 f"p99 with/without job {s['p99_with_to_without']} (medians)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="1 round of 4 s steps and a 10 s job (smoke run)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per wrk step")
    parser.add_argument("--job-seconds", type=float, default=30.0,
                        help="the alone job's size: rows the interactive rate does in this")
    parser.add_argument("--bundle", default="default", help="heron up --bundle (default, null)")
    parser.add_argument("--model", default=None,
                        help="model id (default: minilm, or null-model with --bundle null)")
    parser.add_argument("--workers", default="auto",
                        help="worker processes (auto: as many as heron serve --workers auto)")
    parser.add_argument("--saturate-clients", type=int, default=32)
    parser.add_argument("--latency-clients", type=int, default=8)
    parser.add_argument("--shards-in-flight", type=int, default=0,
                        help="HERON_GATEWAY_JOB_SHARDS_IN_FLIGHT (0: as shipped)")
    parser.add_argument("--shard-rows", type=int, default=0,
                        help="HERON_GATEWAY_JOB_SHARD_ROWS (0: as shipped)")
    parser.add_argument("--split-cores", action="store_true",
                        help="one worker whose inference has CPU 0 to itself; everything "
                             "else on the other CPUs (bench/cluster_bench.py's layout)")
    parser.add_argument("--no-plot", action="store_true", help="no PNG")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so local_cluster stops the `heron up` it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "job_bench.json").write_text(text + "\n")
    if not args.no_plot:
        try:
            if plot(report, args.out / "job_bench.png"):
                log(f"plot: {args.out / 'job_bench.png'}")
            else:
                log("no plot: matplotlib is not installed")
        except Exception as exc:  # a figure must not lose the run's numbers
            log(f"no plot: {exc!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
