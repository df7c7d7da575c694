"""The result cache's shared tier (worker/shared_results.py) without NATS: its key changes
with everything an output depends on and nothing else, the weights' digest follows their
bytes, values round-trip and anything else decodes to a miss; and the runner's use of it
(worker/runner.py): a tier hit is answered ``cached`` without computing, a miss is computed
and stored, a slow tier costs its timeout and no error, ``cache=False`` and LoRA items
never reach it, a config change moves the keys."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import numpy as np
import pytest
from nats.js.errors import KeyNotFoundError

from heron.runtime.modelconfig import ModelConfig, Profile, WeightSource
from heron.worker.result_cache import ResultCache
from heron.worker.runner import ModelRunner
from heron.worker.shared_results import (
    MAX_VALUE_BYTES,
    VALUE_VERSION,
    SharedIdentity,
    SharedResults,
    decode_value,
    encode_value,
    shared_key,
    weights_digest,
)
from heron_sdk.types import Entity, SparseVector
from tests.unit.test_result_cache import CountingAdapter, running, tok

KV_KEY = re.compile(r"[-/_=.a-zA-Z0-9]+")  # what NATS accepts as a KV key


def config(**profile: Any) -> ModelConfig:
    return ModelConfig(id="org/model-1", adapter="dense", source=WeightSource(path="/m"),
                       profiles={"default": Profile(**profile)})


def identity(**changes: Any) -> SharedIdentity:
    base = SharedIdentity.of("org/model-1", "ab" * 32, Profile(), "dense", "cpu", "float32")
    return dataclasses.replace(base, **changes)


# ---- keys -----------------------------------------------------------------------------
def test_the_key_is_the_same_for_the_same_inputs_and_valid_in_nats() -> None:
    scope = identity().scope(config())
    assert scope == identity().scope(config())  # another worker computes the same
    key = shared_key(scope, bytes(range(16)))
    assert KV_KEY.fullmatch(key) and key.startswith("org_model-1.")
    assert key.endswith(".000102030405060708090a0b0c0d0e0f") and len(key) < 128
    # The device index does not matter (cuda:0 and cuda:1 compute alike), its type does.
    gpu = SharedIdentity.of("org/model-1", "ab" * 32, Profile(), "dense", "cuda:1", "float16")
    assert gpu.compute == "cuda/float16"


def test_the_key_changes_with_everything_the_output_depends_on() -> None:
    base = identity().scope(config())
    added = dataclasses.replace(config(), profiles={"default": Profile(),
                                                    "short": Profile(max_sequence_length=8)})
    others = [identity(weights="cd" * 32).scope(config()),
              identity(family="sparse").scope(config()),
              identity(compute="cpu/bfloat16").scope(config()),
              identity(model_id="org/model-2").scope(config()),
              SharedIdentity.of("org/model-1", "ab" * 32, Profile(pooling="cls"), "dense",
                                "cpu", "float32").scope(config()),
              identity().scope(config(normalize=False)),  # a config delta
              identity().scope(added)]  # a profile added: any config change is a new key
    assert len({base, *others}) == len(others) + 1


def test_the_weights_digest_follows_the_bytes_not_the_path(tmp_path: Path) -> None:
    def model(name: str, weights: bytes) -> Path:
        root = tmp_path / name
        (root / "1_Pooling").mkdir(parents=True)
        (root / "config.json").write_text("{}")
        (root / "1_Pooling" / "config.json").write_text('{"mean": true}')
        (root / "model.safetensors").write_bytes(weights)
        return root

    a, b = model("a", b"\x00" * 3_000_000), model("b", b"\x00" * 3_000_000)
    assert weights_digest(a) == weights_digest(b)  # two workers, two paths, same files
    # Markers of the weight cache and compiled Python are not the model.
    (b / ".complete").write_text("{}")
    (b / "__pycache__").mkdir()
    (b / "__pycache__" / "x.pyc").write_bytes(b"\x01")
    assert weights_digest(a) == weights_digest(b)
    time.sleep(0.01)  # a new mtime: the memo cannot hide the change
    (b / "model.safetensors").write_bytes(b"\x00" * 2_999_999 + b"\x01")
    assert weights_digest(a) != weights_digest(b)
    c = model("c", b"\x00" * 3_000_000)
    (c / "1_Pooling" / "config.json").write_text('{"mean": false}')
    assert weights_digest(a) != weights_digest(c)


# ---- values ---------------------------------------------------------------------------
def test_values_round_trip_with_their_dtypes() -> None:
    dense = {"dense": np.linspace(-1, 1, 384, dtype=np.float32)}
    data = encode_value(dense)
    assert data is not None and data[0] == VALUE_VERSION and len(data) < 1536 + 100
    back = decode_value(data)
    assert back.keys() == {"dense"} and back["dense"].dtype == np.float32
    np.testing.assert_array_equal(back["dense"], dense["dense"])
    sparse = {"sparse": SparseVector(indices=np.array([3, 9], dtype=np.int32),
                                     values=np.array([0.5, 0.25], dtype=np.float32)),
              "dense": np.ones(4, dtype=np.float16)}
    back = decode_value(encode_value(sparse) or b"")
    assert isinstance(back["sparse"], SparseVector) and back["sparse"].to_dict() == {
        3: 0.5, 9: 0.25}
    assert back["sparse"].indices.dtype == np.int32 and back["dense"].dtype == np.float16
    assert decode_value(encode_value(0.8125) or b"") == 0.8125  # a cross-encoder's score


class LazyOutputs(dict):
    """Like the multi-vector adapter's outputs: a dict that computes a key when read."""


@pytest.mark.parametrize("value", [
    LazyOutputs(dense=np.ones(2, dtype=np.float32)),
    [Entity(label="x", text="y", start=0, end=1, score=0.5)],
    {"dense": np.array(["a"], dtype=object)},
    {"dense": [1.0, 2.0]},
    {},
    np.float64(0.5),
    {"dense": np.zeros(MAX_VALUE_BYTES // 4, dtype=np.float32)},  # over the bound
], ids=["dict-subclass", "entities", "object-array", "list", "empty", "numpy-scalar", "big"])
def test_what_cannot_be_rebuilt_exactly_is_not_shared(value: Any) -> None:
    assert encode_value(value) is None


@pytest.mark.parametrize("data", [
    b"",
    bytes([VALUE_VERSION + 1]) + msgpack.packb(["f", 1.0]),  # another version
    bytes([VALUE_VERSION]) + b"\xc1garbage",
    bytes([VALUE_VERSION]) + msgpack.packb(["m", [["dense", "a", 1]]]),
    bytes([VALUE_VERSION]) + msgpack.packb(["m", [["dense", "x"]]]),
    bytes([VALUE_VERSION]) + msgpack.packb(["m", "dense"]),
    bytes([VALUE_VERSION]) + msgpack.packb(["f", "1.0"]),
    bytes([VALUE_VERSION]) + msgpack.packb({"nd": True}),
    bytes([VALUE_VERSION]) + msgpack.packb(  # an object array (a pickle): never decoded
        ["m", [["dense", "a", {b"nd": True, b"type": "|O", b"kind": b"O", b"shape": [1],
                              b"data": b"x"}]]]),
], ids=["empty", "version", "garbage", "not-array", "bad-kind", "not-list", "str-score",
        "map", "object-array"])
def test_whatever_fails_to_decode_is_a_miss(data: bytes) -> None:
    assert decode_value(data) is None


# ---- the tier's lookups, with a stand-in bucket ---------------------------------------------
class FakeKV:
    """A bucket in a dict; ``delay_s`` slows every get; ``fail`` makes them raise."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.data: dict[str, bytes] = {}
        self.delay_s = delay_s
        self.fail: Exception | None = None
        self.gets = 0

    async def get(self, key: str, validate_keys: bool = True) -> Any:
        self.gets += 1
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        if key not in self.data:
            raise KeyNotFoundError
        return SimpleNamespace(value=self.data[key])


class FakeJS:
    def __init__(self, kv: FakeKV) -> None:
        self.kv = kv

    async def publish(self, subject: str, payload: bytes, timeout: float) -> None:
        self.kv.data[subject.removeprefix("$KV.heron_results.")] = payload


def tier(kv: FakeKV, timeout_s: float = 0.05) -> SharedResults:
    shared = SharedResults(1 << 20, 60.0, timeout_s)
    shared._kv, shared._js = kv, FakeJS(kv)  # type: ignore[assignment]
    shared._nc = SimpleNamespace(is_connected=True)  # type: ignore[assignment]
    return shared


async def test_a_slow_or_failing_bucket_is_an_error_within_the_timeout() -> None:
    slow = tier(FakeKV(delay_s=5.0), timeout_s=0.05)
    started = time.monotonic()
    assert await slow.get_many(["a", "b"]) == [None, None]
    assert time.monotonic() - started < 1.0 and slow.stats.errors == 2
    broken = FakeKV()
    broken.fail = RuntimeError("no responders")
    failing = tier(broken)
    assert await failing.get_many(["a"]) == [None] and failing.stats.errors == 1
    away = tier(FakeKV())
    away._nc = SimpleNamespace(is_connected=False)  # type: ignore[assignment]
    assert await away.get_many(["a"]) == [None] and away.stats.errors == 1
    unbound = SharedResults(1 << 20, 60.0, 0.05)
    assert await unbound.get_many(["a"]) == [None] and unbound.stats.errors == 1
    unbound.store("a", 1.0)  # nowhere to write: dropped, no error
    assert unbound.stats.dropped == 1


async def test_undecodable_values_are_misses_and_stores_are_bounded() -> None:
    kv = FakeKV()
    shared = tier(kv)
    kv.data["bad"] = b"\x7fnot ours"
    shared.store("good", {"dense": np.ones(3, dtype=np.float32)})
    shared.store("lazy", LazyOutputs(dense=np.ones(3, dtype=np.float32)))  # not shareable
    await asyncio.sleep(0)
    found = await shared.get_many(["bad", "good", "none"])
    assert found[0] is None and found[2] is None
    np.testing.assert_array_equal(found[1]["dense"], [1, 1, 1])
    s = shared.stats
    assert (s.hits, s.misses, s.errors, s.stored, s.dropped) == (1, 2, 0, 1, 1)
    shared._stores = {asyncio.get_running_loop().create_future()  # type: ignore[misc]
                      for _ in range(64)}  # as many stores in flight as allowed
    shared.store("more", 1.0)
    assert shared.stats.dropped == 2 and "more" not in kv.data


# ---- the runner ---------------------------------------------------------------------------
def shared_runner(kv: FakeKV, timeout_s: float = 0.05) -> ModelRunner:
    results = ResultCache(1 << 20)
    results.shared = tier(kv, timeout_s)
    runner = ModelRunner(CountingAdapter(), tokenize_pool=ThreadPoolExecutor(1),  # type: ignore[arg-type]
                         results=results)
    runner.share(identity(), config())
    return runner


async def test_a_tier_hit_is_answered_cached_and_a_miss_is_computed_and_stored() -> None:
    kv = FakeKV()
    other = shared_runner(kv)  # another worker, same model, weights and config
    runner = shared_runner(kv)
    async with running(other) as computing:
        first = await other.infer([tok(1, 2), tok(3)])
        await asyncio.sleep(0.01)  # the background stores
        assert [r.cached for r in first] == [False, False] and len(kv.data) == 2
        assert sorted(computing.computed) == [(1, 2), (3,)]
    async with running(runner) as adapter:
        out = await runner.infer([tok(1, 2), tok(3), tok(4), tok(1, 2)])
        assert [r.cached for r in out] == [True, True, False, True]
        np.testing.assert_array_equal(out[0].value["dense"], [1, 2])
        assert adapter.computed == [(4,)]  # only what no one had computed
        stats = runner.results.stats
        assert (stats.shared, stats.misses, stats.joins) == (2, 1, 1)
        assert len(runner.results) == 3  # tier hits are kept locally too
        assert (await runner.infer([tok(3)]))[0].cached and kv.gets == 2 + 3  # local now
        await asyncio.sleep(0.01)
        assert len(kv.data) == 3  # (4,) stored; the tier's own hits are not written again


async def test_identical_items_during_a_lookup_join_it() -> None:
    kv = FakeKV(delay_s=0.02)
    runner = shared_runner(kv, timeout_s=1.0)
    async with running(runner) as adapter:
        answers = await asyncio.gather(*(runner.infer([tok(8)]) for _ in range(5)))
        assert adapter.computed == [(8,)] and kv.gets == 1
        assert sum(not a[0].cached for a in answers) == 1


async def test_a_slow_tier_costs_its_timeout_and_no_error() -> None:
    runner = shared_runner(FakeKV(delay_s=5.0), timeout_s=0.05)
    async with running(runner) as adapter:
        started = time.monotonic()
        out = await runner.infer([tok(6)])
        assert not out[0].cached and adapter.computed == [(6,)]
        assert time.monotonic() - started < 2.0
        assert runner.results.shared.stats.errors == 1


async def test_cache_false_and_lora_items_never_reach_the_tier() -> None:
    kv = FakeKV()
    runner = shared_runner(kv)
    async with running(runner):
        await runner.infer([tok(2)], cache=False)
        await runner.infer([tok(2)], lora=SimpleNamespace(name="legal", source="path:/a"))
        await asyncio.sleep(0.01)
        assert kv.gets == 0 and not kv.data


async def test_a_config_change_moves_the_keys_and_an_unload_drops_them() -> None:
    runner = shared_runner(FakeKV())
    before = runner.shared_scope
    runner.invalidate_results(config(normalize=False))  # ModelRegistry.apply_bundle
    assert runner.shared_scope not in (None, before)
    runner.invalidate_results()  # unloaded: no config to key by
    assert runner.shared_scope is None
