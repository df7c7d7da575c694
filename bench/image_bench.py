"""Image benchmark: image items per second through ``heron serve`` with a tiny CLIP, on CPU.

    python -m bench.image_bench [--quick] [--out DIR]

1. Build a tiny random-weight CLIP with ViT-B/32's geometry (224 px, 32 px patches: 50
   patches an image) at tiny widths, so the model's forward pass is cheap and what is
   measured is Heron's image path: base64, decoding, resize and crop, normalizing, batching.
2. Start ``heron serve`` (``--workers``, default auto) on a free 127.0.0.1 port; warm up.
3. At each concurrency (1, 8, 32 clients), closed loop with wrk (bench/wrk_encode.lua):
   every request is one photo-like JPEG (320 x 240, ~10 KB; 16 different ones) as a JSON
   base64 item to /v1/encode.
4. Print one JSON document and write it to DIR/image_bench.json (DIR: bench/results/).

Progress goes to stderr; stdout carries only the JSON.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import io
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from bench.load import run_wrk
from bench.server import start_server
from tests.support.tiny_vision import build_tiny_clip

MODEL = "bench-clip"
DEFAULT_OUT = Path(__file__).with_name("results")


def write_bundle(root: Path) -> Path:
    model_dir = build_tiny_clip(root / "clip", image_size=224, patch_size=32)
    (root / "models").mkdir()
    config = {"id": f"bench/{MODEL}", "aliases": [MODEL], "adapter": "clip",
              "source": {"path": str(model_dir)}, "profiles": {"default": {}}}
    (root / "models" / f"{MODEL}.yaml").write_text(yaml.safe_dump(config))
    bundle = root / "image-bench.yaml"
    bundle.write_text(yaml.safe_dump({"name": "image-bench", "models": [f"{MODEL}.yaml"]}))
    return bundle


def photo_like(n: int, width: int = 320, height: int = 240) -> bytes:
    """A JPEG that compresses like a photo (smooth gradients, a little noise): ~10 KB."""
    rng = np.random.default_rng(n)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 255
    pixels = np.clip(base * rng.uniform(0.5, 1.0, 3) + rng.normal(0, 6, base.shape), 0, 255)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="JPEG", quality=85)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s steps (default 10 s)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per server process (0: heron serve's choice)")
    parser.add_argument("--workers", default="auto",
                        help="heron serve --workers (auto: one process per CPU, up to 4)")
    args = parser.parse_args()
    duration = 3.0 if args.quick else 10.0
    images = [photo_like(n) for n in range(16)]
    steps = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bodies = root / "bodies.jsonl"
        bodies.write_text("".join(json.dumps({"items": [{"image": base64.b64encode(
            image).decode()}], "cache": False}) + "\n" for image in images))
        bundle = write_bundle(root)
        with start_server(root / "serve.log", bundle=str(bundle), workers=args.workers,
                          threads=args.threads) as server:
            url = f"http://127.0.0.1:{server.port}/v1/encode/{MODEL}"
            run_wrk(url, bodies, connections=4, duration_s=2.0)  # warm up
            for clients in args.clients:
                result = run_wrk(url, bodies, connections=clients, duration_s=duration)
                step = result.summary()
                step["images_per_s"] = step.pop("throughput_rps")
                print(f"{clients} clients: {step['images_per_s']} images/s, "
                      f"p50 {step['latency_ms']['p50']} ms, p99 {step['latency_ms']['p99']} ms",
                      file=sys.stderr)
                steps.append(step)
    result_doc = {
        "bench": "image_bench",
        "model": "tiny random CLIP, ViT-B/32 geometry (224 px, 32 px patches: 50 patches), "
                 "hidden size 32, 2 layers",
        "images": {"format": "JPEG", "width": 320, "height": 240, "count": len(images),
                   "mean_bytes": int(np.mean([len(i) for i in images]))},
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "load_average": os.getloadavg()},
        "workers": args.workers, "threads": args.threads, "step_s": duration,
        "steps": steps}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "image_bench.json").write_text(json.dumps(result_doc, indent=2) + "\n")
    print(json.dumps(result_doc, indent=2))


if __name__ == "__main__":
    main()
