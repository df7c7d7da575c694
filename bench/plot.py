"""Optional PNG of a serve_bench result; needs matplotlib, which Heron does not depend on."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(result: dict[str, Any], path: Path) -> bool:
    """Write the figure; False (and nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = result["concurrency"]
    clients = [s["connections"] for s in steps]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(clients, [s["throughput_rps"] for s in steps], "o-", label="heron serve")
    ceiling = result["ceiling"]["sentences_per_s"]
    left.axhline(ceiling, color="grey", linestyle="--",
                 label=f"raw model ceiling ({ceiling:.0f}/s)")
    left.set(xscale="log", xlabel="concurrent clients (wrk connections)",
             ylabel="sentences / s", title="Throughput", ylim=(0, None))
    for name, style in (("p50", "o-"), ("p99", "s--")):
        right.plot(clients, [s["latency_ms"][name] for s in steps], style, label=name)
    right.set(xscale="log", yscale="log", xlabel="concurrent clients (wrk connections)",
              ylabel="latency (ms)", title="Latency")
    for ax in (left, right):
        ax.set_xticks(clients, [str(c) for c in clients])
        ax.grid(True, alpha=0.3)
        ax.legend()
    workload = result["workload"]
    fig.suptitle(f"Heron {result['model']}: {workload['n_texts']} texts, "
                 f"{workload['tokens_p50']}/{workload['tokens_p90']}/"
                 f"{workload['tokens_max']} tokens p50/p90/max, "
                 f"{result['machine']['cpu_count']} CPUs")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
