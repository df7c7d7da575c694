"""How fast a POSTed model becomes routable: config service -> JetStream -> gateway.

    python -m bench.config_propagation [--models N] [--out DIR]

Starts ``heron up`` (one worker), POSTs N new model configs one after another (the tiny
MiniLM-weights dense config under new ids) and, for each, times from the POST until the
gateway's GET /v1/models/{id} answers 200. Prints JSON: per-model seconds, p50, p90, max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.cluster_bench import local_cluster, log
from bench.server import REPO, http
from bench.texts import model_dir


def run(n: int, out: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="heron-config-bench-"))
    seconds = []
    with local_cluster("default", work / "up") as (gateway, _worker):
        text = (work / "up" / "up.log").read_text()
        config_url = text.split("config service on ")[1].split()[0]
        for i in range(n):
            model_id = f"bench/{uuid.uuid4().hex[:8]}-{i}"
            body = {"id": model_id, "adapter": "dense", "source": {"path": str(model_dir())},
                    "profiles": {"default": {"max_sequence_length": 128}}}
            started = time.monotonic()
            status, answer = http("POST", f"{config_url}/v1/configs/models", body)
            if status != 201:
                raise RuntimeError(f"POST {model_id}: {status} {answer}")
            while http("GET", f"{gateway}/v1/models/{model_id}", timeout=5)[0] != 200:
                if time.monotonic() - started > 30:
                    raise RuntimeError(f"{model_id} never routed")
                time.sleep(0.002)
            seconds.append(time.monotonic() - started)
    ordered = sorted(seconds)
    result = {"benchmark": "config_propagation", "models": n,
              "seconds": [round(s, 4) for s in seconds],
              "p50_s": round(statistics.median(ordered), 4),
              "p90_s": round(ordered[int(0.9 * (n - 1))], 4), "max_s": round(ordered[-1], 4)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config_propagation.json").write_text(json.dumps(result, indent=2))
    log(f"POST -> routable: p50 {result['p50_s']} s, max {result['max_s']} s")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=20)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.models, args.out), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
