"""Every limit and timeout a worker operator sets: the flags of ``heron worker`` and their
variables (heron.runtime.settings; the reference table in docs/operations.md is checked
against it).

``heron worker`` builds these from its flags and variables, refuses a bad value before it
loads anything, and writes them back into its environment (``export_env``), where the parts
that read a variable find them (worker/memory.py: HERON_MEMORY_THRESHOLD_PERCENT,
HERON_MODEL_MEMORY_BUDGET, HERON_IDLE_EVICT_S, HERON_HEAP_TRIM_S; heron.runtime.nats_names:
HERON_STREAM_REPLICAS). Code that wants the rest (worker/app.py, worker/cluster.py) takes
``WorkerSettings.from_env()`` once. No torch here: the command's parser imports
this module for every command.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from heron.runtime.settings import InferenceServerSettings, setting
from heron_sdk.types import MAX_BODY_BYTES

# Queue mode: items held beyond the running forward pass. 16 on CPU (measured, see
# LaneFetcher._fetch_loop in worker/fetching.py); 128 on a GPU, where a forward pass takes
# milliseconds and batches must be big to use the device.
CPU_FETCH_LOOKAHEAD = 16
GPU_FETCH_LOOKAHEAD = 128
# While a forward pass runs, a CPU worker holds nothing more: what arrives meanwhile waits in
# the stream for whichever worker is free first (LaneFetcher.lookahead). On a GPU the pass
# is short and the next batch is fetched and tokenized during it, so the lookahead stays.
CPU_FETCH_LOOKAHEAD_BUSY = 0


@dataclass(frozen=True, slots=True)
class WorkerSettings(InferenceServerSettings):
    """The worker's knobs. The work stream's (``stream_*``, inherited) must match the
    gateway's: both declare the pool's stream and consumer; the HTTP API's
    (``default_model``, ``cors_origins``, inherited) are every inference server's."""

    env_prefix: ClassVar[str] = "HERON_WORKER_"

    fetch_lookahead: int | None = setting(
        None, "Queue mode: items a worker holds beyond the batch it is running; the rest "
              "stays in the stream for the pool's other workers (auto: by device)",
        env="HERON_FETCH_LOOKAHEAD", minimum=1,
        shown=f"`auto`: {CPU_FETCH_LOOKAHEAD} on CPU, {GPU_FETCH_LOOKAHEAD} on CUDA")
    fetch_lookahead_busy: int | None = setting(
        None, "Queue mode: the same while a forward pass is running; what arrives meanwhile "
              "is left to a free worker (auto: by device)", env="HERON_FETCH_LOOKAHEAD_BUSY",
        minimum=0,
        shown=f"`auto`: {CPU_FETCH_LOOKAHEAD_BUSY} on CPU, the lookahead on CUDA")
    default_timeout_s: float = setting(
        30.0, "Deadline of a request to the worker's own HTTP API that sets no timeout_s",
        above=0)
    max_work_items_in_flight: int = setting(
        128, "Queue mode: work items a worker has taken and not finished, at most", minimum=1)
    drain_timeout_s: float = setting(
        60.0, "Queue mode, after SIGTERM: how long the worker may take to finish and "
              "acknowledge the work it holds (what is left goes to other workers after "
              "the ack wait)")
    max_body_bytes: int = setting(
        MAX_BODY_BYTES, "Largest request body of the worker's own HTTP API, before 413 "
                        "PAYLOAD_TOO_LARGE", minimum=1, size=True)
    memory_threshold_percent: float = setting(
        85.0, "Evict the least recently used idle model while the device's memory use is at "
              "or above this percentage", env="HERON_MEMORY_THRESHOLD_PERCENT", minimum=1,
        maximum=100)
    model_memory_budget: int | None = setting(
        None, "Bytes the loaded models' weights may take together (800MB, 1.5GiB, 123456; "
              "none: no budget)", env="HERON_MODEL_MEMORY_BUDGET", minimum=1, size=True)
    idle_evict_s: float = setting(
        0.0, "Also evict a model nobody used for this many seconds (0: never)",
        env="HERON_IDLE_EVICT_S")
    result_cache_bytes: int = setting(
        256 * 1024**2, "Bytes of model outputs each worker process keeps to answer repeated "
                       "items (LRU; 0: no result cache, no in-flight sharing)",
        env="HERON_RESULT_CACHE_BYTES", minimum=0, size=True)
    result_cache_shared_bytes: int = setting(
        0, "Queue mode: bytes of the result cache's shared tier, the NATS KV bucket "
           "heron_results that every worker reads and writes, so an item one worker "
           "computed is answered by the others (oldest entries go first; 0: off)",
        env="HERON_RESULT_CACHE_SHARED_BYTES", minimum=0, size=True)
    result_cache_shared_ttl_s: float = setting(
        86400.0, "Queue mode: how long an entry of the result cache's shared tier lives",
        env="HERON_RESULT_CACHE_SHARED_TTL_S", above=0)
    result_cache_shared_timeout_s: float = setting(
        0.05, "Queue mode: longest a request waits for the shared tier's answer before it "
              "computes its items (a slow or absent NATS costs at most this)",
        env="HERON_RESULT_CACHE_SHARED_TIMEOUT_S", above=0)
    heap_trim_s: float = setting(
        5.0, "Every this many seconds, between batches, hand freed heap pages back to the OS "
             "(glibc malloc_trim; 0: never)", env="HERON_HEAP_TRIM_S")

    def lookahead(self, on_gpu: bool) -> int:
        """``fetch_lookahead``, or its default for the device."""
        if self.fetch_lookahead is not None:
            return self.fetch_lookahead
        return GPU_FETCH_LOOKAHEAD if on_gpu else CPU_FETCH_LOOKAHEAD

    def lookahead_busy(self, on_gpu: bool) -> int:
        """``fetch_lookahead_busy``, or its default for the device."""
        if self.fetch_lookahead_busy is not None:
            return self.fetch_lookahead_busy
        return self.lookahead(on_gpu) if on_gpu else CPU_FETCH_LOOKAHEAD_BUSY
