"""The worker's result cache: what a model computed per item, kept in memory (LRU, bounded
in bytes), and the in-flight table that lets identical items share one computation.

What is cached is an item's model output (``ItemResult.value``: the adapter's postprocess
output) before any per-request shaping (Matryoshka dims, output dtype, wire encoding), so
one entry serves every dims/dtype/encoding a later request asks for. The key says what
determines that output:

- the *scope*: one loaded model under one config (``ModelRunner.cache_scope``: the model id
  and a number that is new for every load and every config change of the model). A reload
  (weights resolved again) or a config delta gives a new scope, so an old entry can never
  match; its entries are dropped as well, to free their bytes at once;
- a digest of the tokenized item: its token ids (the prompt's, the instruction's and the
  input type's tokens are in them), token type ids, the query flag, the prompt tokens
  pooling leaves out, the special-token mask; and the LoRA adapter (name and source).

No I/O here: ``ResultCache`` and ``item_digest`` are plain code (tests/unit/
test_result_cache.py); the runner (worker/runner.py) does the asyncio side. A cluster
worker may add a shared tier behind it (``ResultCache.shared``: worker/shared_results.py,
a NATS KV bucket that every worker reads and writes).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from heron_sdk.types import Entity, SparseVector

if TYPE_CHECKING:
    from heron.worker.shared_results import SharedResults

# Bookkeeping per entry beyond its arrays' bytes: the key tuple, its 16-byte digest, the
# OrderedDict node, the value dict and the numpy array headers. Measured with tracemalloc
# for MiniLM's {"dense": float32[384]} entries: 1536 array bytes, ~1.0 kB more per entry.
ENTRY_OVERHEAD_BYTES = 1024

Key = tuple[str, bytes]  # (scope, item digest)


def value_bytes(value: Any) -> int:
    """Bytes a cached model output holds: its arrays' data plus a fixed overhead."""
    return ENTRY_OVERHEAD_BYTES + _data_bytes(value)


def _data_bytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(_data_bytes(v) for v in value.values())
    if isinstance(value, SparseVector):
        return int(value.indices.nbytes + value.values.nbytes)
    if isinstance(value, list | tuple):
        return sum(_data_bytes(v) for v in value)
    if isinstance(value, Entity):
        return 64 + len(value.text)
    return 32  # a float (a cross-encoder's score) or another scalar


def freeze(value: Any) -> None:
    """Make a cached output's arrays read-only: a later request that changed one in place
    would change every answer served from it (this turns that into an error instead)."""
    if isinstance(value, np.ndarray):
        value.flags.writeable = False
    elif isinstance(value, dict):
        for v in value.values():
            freeze(v)
    elif isinstance(value, SparseVector):
        freeze(value.indices)
        freeze(value.values)


def item_digest(input_ids: list[int], token_type_ids: list[int] | None, query: bool,
                prompt_tokens: int, special_mask: list[int] | None, lora: Any = None) -> bytes:
    """16 bytes that name one tokenized item as the model computes it (blake2b over the
    ids' bytes: about 2 us for a 20-token sentence, well under its tokenization)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(array("q", input_ids).tobytes())
    h.update(b"|t")
    if token_type_ids is not None:
        h.update(array("q", token_type_ids).tobytes())
    h.update(b"|s")
    if special_mask is not None:
        h.update(array("q", special_mask).tobytes())
    h.update(f"|q{int(query)}|p{prompt_tokens}".encode())
    if lora is not None:  # a LoRA adapter: its name and where its weights came from
        h.update(f"|l{lora.name}|{lora.source!r}".encode())
    return h.digest()


@dataclass(slots=True)
class CacheStats:
    hits: int = 0  # items answered from the cache
    misses: int = 0  # cacheable items computed (neither cached nor in flight)
    shared: int = 0  # items answered from the shared tier (another worker computed them)
    joins: int = 0  # items that shared an identical item's computation in flight
    evictions: int = 0  # entries dropped for room (LRU)
    invalidated: int = 0  # entries dropped because their model reloaded or its config changed


class ResultCache:
    """Model outputs by key, least recently used first, bounded in bytes (0: disabled)."""

    def __init__(self, max_bytes: int, size_of: Callable[[Any], int] = value_bytes) -> None:
        self.max_bytes = max_bytes
        self._size_of = size_of
        self._entries: OrderedDict[Key, tuple[Any, int]] = OrderedDict()
        self._by_scope: dict[str, set[bytes]] = {}
        self.bytes = 0
        self.stats = CacheStats()
        # The shared tier (cluster workers with --result-cache-shared-bytes): looked in on
        # a local miss, written after a computation; None: this process's cache only.
        self.shared: SharedResults | None = None

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> Any | None:
        """The cached output (now the most recently used), or None. Counts nothing: the
        runner counts a miss only once it knows the item is not in flight either."""
        found = self._entries.get(key)
        if found is None:
            return None
        self._entries.move_to_end(key)
        return found[0]

    def put(self, key: Key, value: Any) -> bool:
        """Keep ``value``; False if it is larger than the whole bound (kept nowhere)."""
        if not self.enabled:
            return False
        size = self._size_of(value)
        if size > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        freeze(value)
        self._entries[key] = (value, size)
        self._by_scope.setdefault(key[0], set()).add(key[1])
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
            self.stats.evictions += 1
        return True

    def drop_scope(self, scope: str) -> int:
        """Forget every entry of ``scope`` (a model reloaded, evicted or reconfigured)."""
        digests = self._by_scope.pop(scope, set())
        for digest in digests:
            found = self._entries.pop((scope, digest), None)
            if found is not None:
                self.bytes -= found[1]
        self.stats.invalidated += len(digests)
        return len(digests)

    def clear(self) -> int:
        """Forget everything (memory pressure: outputs are cheaper to compute again than a
        model is to load again). Returns the bytes freed."""
        freed, count = self.bytes, len(self._entries)
        self._entries.clear()
        self._by_scope.clear()
        self.bytes = 0
        self.stats.evictions += count
        return freed

    def _remove(self, key: Key) -> None:
        _, size = self._entries.pop(key)
        self.bytes -= size
        digests = self._by_scope.get(key[0])
        if digests is not None:
            digests.discard(key[1])
            if not digests:
                del self._by_scope[key[0]]
