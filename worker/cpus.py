"""CPU placement: the inference thread on CPUs of its own (``--inference-cpus``,
``HERON_INFERENCE_CPUS``).

A worker has one busy thread, the one that runs the forward passes (with its OpenMP team),
and an event loop that parses requests, tokenizes short texts and answers. When the worker
may use more CPUs than it runs torch threads, Linux still moves both wherever it likes: the
event loop wakes on every network packet and lands on the model's CPU, and the model lands
on the CPU where the gateway and NATS run. Measured in bench/cluster_bench.py
--split-cores (1 torch thread, gateway and NATS on the other CPU; interleaved runs in one
cluster): 174 items/s with the threads left free, 189 items/s with the inference thread
alone on one CPU and the rest of the worker on the other; the model's own time per item
went from 5.58 to 5.11 ms.

Off by default: it only helps where the CPUs are the worker's own (a Kubernetes pod with
exclusive CPUs under the static CPU manager policy, a VM, a dedicated machine). Under a
plain CPU quota on a shared node, pinning to CPUs that other pods also use would hurt.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

log = logging.getLogger("heron.worker.cpus")

OFF = "off"
AUTO = "auto"


@dataclass(frozen=True, slots=True)
class CpuPlacement:
    inference: frozenset[int]  # the inference thread and the OpenMP team it starts
    others: frozenset[int]  # the event loop, tokenizer threads, everything else

    def describe(self) -> str:
        return (f"inference thread on CPUs {format_cpu_list(self.inference)}, the rest of "
                f"the worker on {format_cpu_list(self.others)}")


def placement_requested(setting: str) -> bool:
    """Whether an ``--inference-cpus`` value asks for any pinning (not ``off``/empty)."""
    return setting.strip().lower() not in ("", OFF)


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,6"`` -> {0, 1, 2, 3, 6} (the Linux cpuset list format)."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError("expected off, auto, or a CPU list such as 0-3,6")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(f"the range {part} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    ordered, runs = sorted(cpus), []
    for cpu in ordered:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def plan_placement(setting: str, threads: int,
                   allowed: set[int] | frozenset[int]) -> CpuPlacement | None:
    """Where the inference thread and the rest go (None: leave placement to the OS).

    ``auto``: the first ``threads`` of the allowed CPUs for inference, the others for the
    rest, only if the worker may use more CPUs than it runs torch threads. A CPU list:
    those for inference, the remaining allowed ones for the rest (all of them if none
    remain)."""
    if not placement_requested(setting):
        return None
    setting = setting.strip().lower()
    if setting == AUTO:
        if len(allowed) <= threads:
            log.info("inference CPUs auto: %d torch threads on %d usable CPUs, none to spare "
                     "for the event loop; not pinned", threads, len(allowed))
            return None
        inference = frozenset(sorted(allowed)[:threads])
    else:
        inference = parse_cpu_list(setting)
    others = frozenset(allowed) - inference
    return CpuPlacement(inference, others or frozenset(allowed))


def pin_this_thread(cpus: frozenset[int]) -> None:
    """On Linux an affinity belongs to a thread: this moves only the calling thread (and
    the threads it starts later, which inherit it)."""
    os.sched_setaffinity(0, cpus)


def apply_to_process(placement: CpuPlacement) -> None:
    """Check that the inference CPUs can be used (a bad list fails start-up, not every
    forward pass), then move every thread of this process that exists now to the other
    CPUs. Threads started later inherit the CPUs of the thread that starts them; the
    inference thread pins itself (``pin_this_thread`` as its pool's initializer)."""
    try:
        pin_this_thread(placement.inference)
    except OSError as exc:
        raise ValueError(f"CPUs {format_cpu_list(placement.inference)} are not usable by "
                         f"this process ({exc.strerror})") from None
    pin_this_thread(placement.others)
    with contextlib.suppress(OSError):  # no /proc: the calling thread moved, at least
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that has just ended
                os.sched_setaffinity(int(task), placement.others)
    log.info("CPU placement: %s", placement.describe())
