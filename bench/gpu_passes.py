"""The diagnostic and A/B parts of bench/gpu_check.py (run through it: ``python -m
bench.gpu_check OUT first_seen,graphs_ab``), and the worker's pass statistics its speed
steps record.

- ``first_seen``: forward passes of shapes new to the process against seen ones, with
  CUDA's lazy kernel loading and without, and a torch profile (``shape_times``, run as
  ``python -m bench.gpu_passes shape-times MODEL_DIR`` in a fresh process).
- ``serve_settings``: `heron serve` under other batch settings (SERVE_SETTINGS).
- ``graphs_ab``: `heron serve` with CUDA graphs off and on (worker/adapters/cuda_graphs.py).
- ``raw_shapes`` / ``ab_cudnn``: first-seen shapes with torch's cuDNN attention on and off,
  and `heron serve` with HERON_CUDNN_ATTENTION 1 and 0.
- ``profile``: py-spy (if on PATH) of `heron serve` under load.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from typing import Any

import torch

from bench import gpu_check as run

# The worker's histograms whose _sum and _count make a step's pass statistics.
PASS_METRICS = ("heron_worker_batch_inference_seconds", "heron_worker_batch_items",
                "heron_worker_batch_padded_tokens", "heron_worker_phase_duration_seconds")
_LINE = re.compile(r'^(\w+?)_(sum|count)(\{[^}]*\})? ([0-9.eE+-]+)$')


def metric_sums(text: str) -> dict[str, float]:
    """``name[:phase]/sum|count`` -> value, summed over the other labels."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        found = _LINE.match(line)
        if not found or found.group(1) not in PASS_METRICS:
            continue
        name, kind, labels, value = found.groups()
        phase = re.search(r'phase="(\w+)"', labels or "")
        key = f"{name}:{phase.group(1)}" if phase else name
        sums[f"{key}/{kind}"] = sums.get(f"{key}/{kind}", 0.0) + float(value)
    return sums


def pass_stats(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Passes run between two ``metric_sums``, their mean items, padded tokens and time, and
    each request phase's mean time."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)
    passes = delta("heron_worker_batch_inference_seconds/count")
    out: dict[str, Any] = {"passes": int(passes)}
    if passes:
        out["mean_items"] = round(delta("heron_worker_batch_items/sum") / passes, 1)
        out["mean_padded_tokens"] = round(
            delta("heron_worker_batch_padded_tokens/sum") / passes)
        out["mean_pass_ms"] = round(
            1000 * delta("heron_worker_batch_inference_seconds/sum") / passes, 2)
    for key in sorted(after):
        if key.startswith("heron_worker_phase_duration_seconds:") and key.endswith("/sum"):
            phase = key.split(":")[1].split("/")[0]
            n = delta(key.replace("/sum", "/count"))
            if n:
                out[f"{phase}_ms"] = round(1000 * delta(key) / n, 2)
    return out


def forward_ms(model: torch.nn.Module, shapes: list[tuple[int, int]], multiple: int = 1,
               masked: Any = None, copy_out: bool = False, high: int = 2000) -> list[float]:
    """Milliseconds of one forward pass each, on random ids below ``high`` of each ``(rows,
    length)`` shape (width rounded up to ``multiple``); ``masked(mask, length)`` pads the
    batch's rows; ``copy_out``: the states come back to the CPU in fp32, as an answer's do."""
    times = []
    for rows, length in shapes:
        width = -(-length // multiple) * multiple
        ids = torch.randint(1000, high, (rows, width), device="cuda")
        mask = torch.ones(rows, width, dtype=torch.long, device="cuda")
        if masked is not None:
            masked(mask, length)
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            states = model(input_ids=ids, attention_mask=mask).last_hidden_state
            if copy_out:
                states.float().cpu()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - started))
    return times


def brief(times: list[float]) -> dict[str, float]:
    s = sorted(times)
    return {"median_ms": round(s[len(s) // 2], 2), "mean_ms": round(sum(s) / len(s), 2),
            "max_ms": round(s[-1], 2), "first_ms": round(times[0], 2)}


def shape_times(model_dir: str, n: int = 40, seed: int = 7) -> dict[str, Any]:
    """In this process: forward times (ms) of BERT in fp16 over sets of ``n`` random shapes
    a server at 32 clients forms (1-32 rows, 8-128 tokens), each set new to the process;
    the first set again; a profile of one more new set; and a new set with its widths
    rounded up to a multiple of 16."""
    from transformers import AutoModel
    torch.backends.cuda.enable_cudnn_sdp(False)  # as the worker does on CUDA
    started = time.perf_counter()
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float16).cuda().eval()
    out: dict[str, Any] = {"load_s": round(time.perf_counter() - started, 2),
                           "module_loading": os.environ.get("CUDA_MODULE_LOADING", "")}
    rng = random.Random(seed)

    def shapes() -> list[tuple[int, int]]:
        return [(rng.randint(1, 32), rng.randint(8, 128)) for _ in range(n)]

    def mixed(mask: torch.Tensor, length: int) -> None:
        for r in range(mask.shape[0]):  # rows of mixed lengths, as a padded batch has
            mask[r, max(1, length - rng.randint(0, length // 2)):] = 0

    def timed(batch: list[tuple[int, int]], multiple: int = 1) -> list[float]:
        return forward_ms(model, batch, multiple, mixed, copy_out=True, high=20000)

    out["very_first_ms"] = round(timed([(1, 8)])[0], 1)
    sets = [shapes() for _ in range(3)]
    for k, batch in enumerate(sets):
        out[f"new_set_{k}"] = brief(timed(batch))
    out["set_0_again"] = brief(timed(sets[0]))
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out["new_set_profiled"] = brief(timed(shapes()))
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    out["profile_top_self_cpu"] = [
        {"op": e.key[:60], "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2),
         "self_device_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 2)}
        for e in top[:14]]
    out["new_set_width16"] = brief(timed(shapes(), multiple=16))
    out["seen_32x64"] = brief(timed([(32, 64)] * 20))
    out["seen_1x16"] = brief(timed([(1, 16)] * 20))
    return out


def profile():
    """Why heron serve on CUDA makes ~1,100 items/s where the model makes 9,000+."""
    import httpx

    from bench.server import start_server
    ts = run.texts(2048)
    _, batch = run.load_bodies(ts)
    b = run.bundle("gpu-prof", ["base-a"])
    out: dict = {}
    with start_server(run.WORK / "serve-prof.log", bundle=b, workers="1",
                      extra_args=("--device", "cuda")) as srv:
        url = f"{srv.url}/v1/encode/g-base-a"
        for k in (1, 64, 64):
            r = httpx.post(url, json={"items": ts[:k], "cache": False}, timeout=60)
            out[f"idle_{k}_texts"] = {"status": r.status_code,
                                      "server_timing": r.headers.get("server-timing")}
        run.wrk_step(url, batch, 16, 3)
        if shutil.which("py-spy") is None:
            raise RuntimeError("py-spy is not on PATH")
        spy = subprocess.Popen(["py-spy", "record", "-p", str(srv.pid),
                                "--subprocesses", "-r", "100", "-d", "8", "-f", "raw",
                                "--threads", "-o", str(run.OUT / "spy.txt")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        out["under_spy"] = run.wrk_step(url, batch, 16, 10)
        spy.wait(timeout=60)
        out["spy_rc"] = spy.returncode
        out["spy_err"] = spy.stderr.read().decode()[-500:] if spy.stderr else ""
        r = httpx.post(url, json={"items": ts[:64], "cache": False}, timeout=60)
        out["after_64"] = r.headers.get("server-timing")
        out["metrics"] = [line for line in httpx.get(f"{srv.url}/metrics", timeout=10).text
                          .splitlines() if "_sum" in line or "_count" in line]
        with contextlib.suppress(FileNotFoundError):
            out["smi_after"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                 "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    return out


def raw_shapes():
    """Forward time of first-seen against seen (batch, length) shapes, SDPA with cuDNN on
    and off: does a new shape cost a plan build?"""
    import random

    from transformers import AutoModel
    mdl = AutoModel.from_pretrained(str(run.MODELS / "base-a")).cuda().half().eval()
    b = torch.backends.cuda
    out: dict = {"flags": {"cudnn": b.cudnn_sdp_enabled(), "flash": b.flash_sdp_enabled(),
                           "mem_efficient": b.mem_efficient_sdp_enabled(),
                           "math": b.math_sdp_enabled()}}

    def first_row_half(mask: torch.Tensor, length: int) -> None:
        mask[0, max(1, length // 2):] = 0  # a padded batch's mask

    def timed(shapes: list[tuple[int, int]], mult: int = 1) -> list[float]:
        return forward_ms(mdl, shapes, mult, first_row_half)
    timed([(8, 16)] * 3)
    for n, (name, cudnn, mult) in enumerate([("cudnn_on", True, 1), ("cudnn_off", False, 1),
                                             ("cudnn_on_pad32", True, 32),
                                             ("cudnn_off_again", False, 1)]):
        b.enable_cudnn_sdp(cudnn)
        rng = random.Random(100 + n)
        shapes = [(rng.randint(1, 128), rng.randint(8, 128)) for _ in range(30)]
        first = timed(shapes, mult)
        again = timed(shapes, mult)
        out[name] = {"first_seen": brief(first), "seen": brief(again)}
        run.save()
    b.enable_cudnn_sdp(True)
    return out


def first_seen():
    """``shape_times`` on BERT-base in fresh processes, with CUDA's lazy kernel loading
    (the default) and eager: a cost that falls away with ``CUDA_MODULE_LOADING=EAGER`` is
    kernels loaded at first use, not work per shape."""
    out: dict[str, Any] = {}
    for loading in ("LAZY", "EAGER"):
        proc = subprocess.run([sys.executable, "-m", "bench.gpu_passes", "shape-times",
                               str(run.MODELS / "base-a")], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "CUDA_MODULE_LOADING": loading})
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        out[loading] = json.loads(lines[-1]) if lines else {
            "rc": proc.returncode, "stderr": proc.stderr[-2000:]}
    return out


# (name, the models' default profile): the batch settings a GPU might want
SERVE_SETTINGS = [("defaults", {}), ("no_wait", {"max_wait_ms": 0}),
                  ("big_batches", {"max_batch_items": 512, "max_batch_tokens": 65536})]


def serve_settings():
    """`heron serve` (BERT-base, CUDA) under SERVE_SETTINGS, a 6 s warm-up each, with the
    worker's pass statistics per step."""
    from bench.server import start_server
    one, batch = run.load_bodies(run.texts(2048))
    out: dict = {}
    for name, profile in SERVE_SETTINGS:
        b = run.bundle(f"gpu-settings-{name}", ["base-a"], profile=profile)
        with start_server(run.WORK / f"serve-settings-{name}.log", bundle=b, workers="1",
                          extra_args=("--device", run.DEVICE)) as srv:
            out.update(run.speed_steps(name, f"{srv.url}/v1/encode/g-base-a", one, batch,
                                   worker=srv.url, warm_s=6.0))
        run.save()
    return out


def graphs_ab():
    """`heron serve` with CUDA graphs off (HERON_CUDA_GRAPHS=0) and on (the default), the
    speed steps for each model, and a lone request's Server-Timing after them."""
    import httpx

    from bench.server import start_server
    ts = run.texts(2048)
    one, batch = run.load_bodies(ts)
    b = run.bundle("gpu-graphs", run.CHECK_MODELS)
    out: dict = {}
    for value in ("0", "1"):
        os.environ["HERON_CUDA_GRAPHS"] = value
        with start_server(run.WORK / f"serve-graphs{value}.log", bundle=b, workers="1",
                          extra_args=("--device", run.DEVICE)) as srv:
            for m in run.CHECK_MODELS:
                url = f"{srv.url}/v1/encode/g-{m}"
                out.update(run.speed_steps(f"graphs{value}/{m}", url, one, batch, worker=srv.url))
                out[f"graphs{value}/{m}/lone"] = [httpx.post(
                    url, json={"items": ts[k:k + 1], "cache": False}, timeout=60
                ).headers.get("server-timing") for k in range(3)]
                run.save()
    os.environ.pop("HERON_CUDA_GRAPHS")
    return out


def ab_cudnn():
    """heron serve on CUDA with HERON_CUDNN_ATTENTION=1 (cuDNN SDPA allowed, torch's default)
    and 0 (the worker turns it off)."""
    import httpx

    from bench.server import start_server
    ts = run.texts(2048)
    one, batch = run.load_bodies(ts)
    b = run.bundle("gpu-ab", ["base-a"])
    out: dict = {}
    for value in ("1", "0"):
        os.environ["HERON_CUDNN_ATTENTION"] = value
        with start_server(run.WORK / f"serve-ab{value}.log", bundle=b, workers="1",
                          extra_args=("--device", "cuda")) as srv:
            url = f"{srv.url}/v1/encode/g-base-a"
            idle = []
            for k in (1, 3, 7, 64):
                r = httpx.post(url, json={"items": ts[10 + k:10 + 2 * k], "cache": False},
                               timeout=60)
                idle.append(r.headers.get("server-timing"))
            out[f"cudnn{value}/idle"] = idle
            run.wrk_step(url, batch, 16, 3)
            r = run.wrk_step(url, batch, 16, 6)
            r["items_per_s"] = round(r["rps"] * 64, 1)
            out[f"cudnn{value}/64_texts/16"] = r
            out[f"cudnn{value}/one_text/256"] = run.wrk_step(url, one, 256, 6)
            out[f"cudnn{value}/one_text/32"] = run.wrk_step(url, one, 32, 6)
            run.save()
    os.environ.pop("HERON_CUDNN_ATTENTION")
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["shape-times"] and len(sys.argv) == 3:
        print(json.dumps(shape_times(sys.argv[2])), flush=True)
    else:
        sys.exit(__doc__)
