"""LoRA adapters on a loaded model: up to ``max_loras`` resident (LRU), each request's rows
computed with its own adapter.

Heron applies LoRA itself, unmerged: each adapted ``nn.Linear`` of the model is wrapped
(``LoraLinear``) and computes ``base(x) + B (A x) * scale`` for the rows of the batch whose
request named that adapter, and ``base(x)`` for the others. So one batch may mix adapters
and the base model, every row computed with its own: the batcher needs no key per adapter,
there is nothing to switch between batches, and the weights of the base model are never
changed (a merged adapter would have to be unmerged, in float, exactly). Rows are matched
to tokens through the batch's layout: padded ``[B, L]`` or packed ``[1, T]`` (each packed
token's item is known), and ``[B]`` for a layer that runs on pooled rows.

A module the adapter saved whole (PEFT's ``modules_to_save``: a cross-encoder's trained
``classifier``) is wrapped too (``LoraSwap``): the rows of an adapter that saved it are
computed by its own copy of the module (the base's, with the adapter's weights), the other
rows by the base's. The module must treat the rows of its first argument (dim 0) apart, as a
head on pooled rows or a position-wise layer on padded ``[B, L, H]`` does; where the rows
cannot be told apart (packed ``[1, T, H]``), that adapter's batches are computed apart.

The cost: two small matmuls per adapted layer per adapter in the batch, and for a batch
that mixes adapters a gather and scatter of its rows (bench/lora_bench.py,
docs/benchmarks.md); a saved module runs once more, on its adapter's rows.

Life cycle: a request ``use``s an adapter for as long as its items are queued or computed,
so an adapter in use is never unloaded. Files are read on a thread (torch-free); tensors
are made and wrappers installed on an inference thread while no forward pass of the model
runs (worker/pass_gate.py: with ``--inference-threads N`` several may run at once).
The bytes count in the registry's memory accounting (``resident_bytes``), and the registry
may evict other idle models to make room (``make_room``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from heron.runtime.modelconfig import ModelConfig, WeightSource, lora_source
from heron.worker.adapters import Adapter
from heron.worker.lora_files import LoraFile, LoraFileError, read_lora, resolve_lora
from heron.worker.memory import InsufficientMemory
from heron.worker.pass_gate import PassGate
from heron_sdk.errors import ErrorCode, HeronError

log = logging.getLogger("heron.worker.lora")

# How long a request waits for its adapter's files and tensors before a 503 (the load goes
# on; the retry finds it loaded). A local rank-8 adapter on MiniLM's query and value (0.3
# MB) loaded in 1-4 ms here; a Hub or S3 download takes what the network takes.
LORA_LOAD_WAIT_S = 30.0


@dataclass(slots=True, eq=False)
class LoraWeights:
    """One loaded adapter: per module path of the serving model, (A, B * scale)."""

    name: str
    source: WeightSource
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    nbytes: int
    load_s: float
    # Serving module path -> the adapter's copy of a module it saved whole.
    saved: dict[str, torch.nn.Module] = field(default_factory=dict)
    # An adapted layer of this model once ran on neither the batch's tokens nor its rows
    # (a BERT pooler over a packed sequence): its batches are computed apart from others.
    unmixable: bool = False


class _Unmixable(Exception):
    """A mixed batch met a layer whose rows cannot be told apart: compute it again, split."""


class LoraLinear(torch.nn.Module):
    """A linear layer with LoRA deltas for the rows that asked for them."""

    def __init__(self, base: torch.nn.Linear, path: str, owner: LoraSet) -> None:
        super().__init__()
        self.base = base
        self.lora_path = path
        # Not a submodule: the set is the model's, not part of its weights.
        self.__dict__["_owner"] = owner

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:  # read by code that inspects a model's layers
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        active: ActiveLoras | None = self._owner.active
        return y if active is None else active.apply(self.lora_path, x, y)


class LoraSwap(torch.nn.Module):
    """A module that some adapters saved whole: their rows get their copy's output."""

    def __init__(self, base: torch.nn.Module, path: str, owner: LoraSet) -> None:
        super().__init__()
        self.base = base
        self.lora_path = path
        self.__dict__["_owner"] = owner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        y = self.base(*args, **kwargs)
        active: ActiveLoras | None = self._owner.active
        return y if active is None else active.swap(self.lora_path, args, kwargs, y)


def _inner(module: torch.nn.Module) -> torch.nn.Module:
    while isinstance(module, LoraSwap | LoraLinear):
        module = module.base
    return module


def _plain_copy(module: torch.nn.Module, owner: LoraSet) -> torch.nn.Module:
    """A copy of ``module`` without Heron's wrappers, in it or around it."""
    plain = copy.deepcopy(_inner(module), memo={id(owner): owner})
    for parent in list(plain.modules()):
        for child_name, child in list(parent.named_children()):
            if _inner(child) is not child:
                setattr(parent, child_name, _inner(child))
    return plain


@dataclass(slots=True)
class _Group:
    lora: LoraWeights
    tokens: torch.Tensor | None  # bool mask over the batch's token layout; None: every row
    rows: torch.Tensor | None  # bool mask over the batch's items


class ActiveLoras:
    """The adapters of the batch being computed, and which rows each one owns."""

    def __init__(self, groups: list[_Group]) -> None:
        self.groups = groups
        self.mismatch = False  # the pass is wrong for some rows: it is thrown away

    def apply(self, path: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        for group in self.groups:
            weights = group.lora.modules.get(path)
            if weights is None:
                continue
            a, b = weights
            if group.tokens is None:  # the whole batch is this adapter's
                y = y + F.linear(F.linear(x, a), b)
                continue
            if group.tokens.shape == lead:
                mask = group.tokens
            elif group.rows is not None and group.rows.shape == lead:
                mask = group.rows
            else:  # rows cannot be told apart here: this pass is redone, split by adapter
                group.lora.unmixable = self.mismatch = True
                continue
            y[mask] = y[mask] + F.linear(F.linear(x[mask], a), b)
        return y

    def swap(self, path: str, args: tuple[Any, ...], kwargs: dict[str, Any], y: Any) -> Any:
        """``y``, the base module's output, with the rows of each adapter that saved the
        module at ``path`` computed by its copy instead."""
        out = y
        for group in self.groups:
            module = group.lora.saved.get(path)
            if module is None:
                continue
            if group.tokens is None:  # the whole batch is this adapter's
                return module(*args, **kwargs)
            rows = group.rows
            assert rows is not None
            n = rows.shape[0]
            if not (args and _by_row(args[0], n) and _by_row(out, n)):
                group.lora.unmixable = self.mismatch = True  # redone, split by adapter
                continue
            picked = module(*(a[rows] if _by_row(a, n) else a for a in args),
                            **{k: v[rows] if _by_row(v, n) else v for k, v in kwargs.items()})
            if out is y:
                out = y.clone()  # y may be the module's input (an identity in eval)
            out[rows] = picked.to(out.dtype)
        return out


def _by_row(value: Any, rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == rows


class LoraSet:
    """The LoRA adapters of one loaded model."""

    def __init__(self, adapter: Adapter, infer_pool: Executor,
                 gate: PassGate | None = None) -> None:
        self._adapter = adapter
        # The model's config as it is now: the registry points this at its entry, whose
        # config the config service's deltas replace (adapters added: usable at once).
        self.config_of: Callable[[], ModelConfig] = lambda: adapter.config
        self._infer_pool = infer_pool
        self._resident: OrderedDict[str, LoraWeights] = OrderedDict()  # LRU first
        self._refs: dict[str, int] = {}
        self._loading: dict[str, asyncio.Task[LoraWeights]] = {}
        self._wrapped: dict[str, LoraLinear] = {}
        self._swapped: dict[str, LoraSwap] = {}
        # Each batch's adapters, set by the inference thread that runs it: a thread's own,
        # since several may run passes of this model at once (--inference-threads).
        self._batch = threading.local()
        # Wrapping a layer changes the model: never while another thread runs a pass.
        self._gate = gate or PassGate()
        # Set by the registry: evict other idle models until this many more bytes fit.
        self.make_room: Callable[[int], Awaitable[None]] | None = None

    @property
    def config(self) -> ModelConfig:
        return self.config_of()

    @property
    def active(self) -> ActiveLoras | None:
        """The adapters of the batch this thread is computing (None: the base model)."""
        return getattr(self._batch, "active", None)

    @property
    def model(self) -> torch.nn.Module:
        return self._adapter.model

    @property
    def resident_bytes(self) -> int:
        return sum(lora.nbytes for lora in self._resident.values())

    # ---- request side ---------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def use(self, name: str | None) -> AsyncIterator[LoraWeights | None]:
        """The adapter ``name`` (None: the base model), held loaded until the block ends.
        404 ADAPTER_NOT_FOUND, 502 MODEL_LOAD_FAILED (bad files), 503 (loading longer than
        LORA_LOAD_WAIT_S), 429 QUEUE_FULL (every resident adapter is in use)."""
        source = lora_source(self.config, name)
        if name is None or source is None:
            yield None
            return
        lora = await self._acquire(name, source)
        try:
            yield lora
        finally:
            self._refs[name] -= 1
            if self._resident.get(name) is not lora and self._refs[name] == 0:
                del self._refs[name]

    async def _acquire(self, name: str, source: WeightSource) -> LoraWeights:
        while True:
            lora = self._resident.get(name)
            if lora is not None and lora.source == source:
                self._resident.move_to_end(name)
                self._refs[name] = self._refs.get(name, 0) + 1
                return lora
            task = self._loading.get(name)
            if task is None:
                task = asyncio.get_running_loop().create_task(self._load(name, source))
                self._loading[name] = task
                task.add_done_callback(lambda _t, n=name: self._loading.pop(n, None))
            try:
                await asyncio.wait_for(asyncio.shield(task), LORA_LOAD_WAIT_S)
            except TimeoutError:
                raise HeronError(ErrorCode.MODEL_LOADING, f"adapter {name} of model "
                                 f"{self.config.id} is loading", retry_after_s=2.0) from None

    # ---- loading (event loop, a reader thread, then the inference thread) ----------------
    async def _load(self, name: str, source: WeightSource) -> LoraWeights:
        from heron.worker.weights import WeightsTemporarilyUnavailable, WeightsUnavailable

        label = f"adapter {name} of model {self.config.id}"
        started = time.monotonic()
        try:
            path = await asyncio.to_thread(resolve_lora, self.config.id, name, source)
            data = await asyncio.to_thread(read_lora, path, name)
            paths = self._targets(data)
            saved = self._saved_targets(data)
        except WeightsTemporarilyUnavailable as exc:
            raise HeronError(ErrorCode.MODEL_LOADING, f"{label} cannot load now: {exc}",
                             retry_after_s=exc.retry_after_s) from exc
        except (WeightsUnavailable, LoraFileError, OSError) as exc:
            raise HeronError(ErrorCode.MODEL_LOAD_FAILED,
                             f"{label} failed to load: {exc}") from exc
        self._make_slot(name, data.nbytes)
        loop = asyncio.get_running_loop()
        try:
            if self.make_room is not None:
                await self.make_room(data.nbytes)
            lora = await loop.run_in_executor(self._infer_pool, self._install, name, source,
                                              data, paths, saved, started)
        except LoraFileError as exc:
            raise HeronError(ErrorCode.MODEL_LOAD_FAILED,
                             f"{label} failed to load: {exc}") from exc
        except (InsufficientMemory, MemoryError, torch.OutOfMemoryError) as exc:
            raise HeronError(ErrorCode.INSUFFICIENT_MEMORY, f"{label} cannot load now: {exc}",
                             retry_after_s=5.0) from exc
        self._make_slot(name, lora.nbytes)  # another load may have finished meanwhile
        old = self._resident.pop(name, None)
        self._resident[name] = lora
        if old is not None:
            log.info("%s reloaded (its source changed)", label)
        log.info("%s loaded in %.0f ms (%d layers, rank %d, %d modules saved whole, "
                 "%.1f MB)", label, lora.load_s * 1000, len(lora.modules), data.rank,
                 len(lora.saved), lora.nbytes / 1e6)
        return lora

    def _make_slot(self, name: str, nbytes: int) -> None:
        """Unload least recently used idle adapters until one more fits max_loras."""
        while len([n for n in self._resident if n != name]) >= self.config.max_loras:
            victim = next((n for n in self._resident
                           if n != name and self._refs.get(n, 0) == 0), None)
            if victim is None:
                raise HeronError(ErrorCode.QUEUE_FULL,
                                 f"model {self.config.id} has its {self.config.max_loras} "
                                 f"adapter slots (max_loras) in use; retry shortly",
                                 retry_after_s=1.0)
            gone = self._resident.pop(victim)
            log.info("unloaded adapter %s of model %s (LRU, %.1f MB)", victim,
                     self.config.id, gone.nbytes / 1e6)

    def _targets(self, data: LoraFile) -> dict[str, str]:
        """PEFT module path -> the serving model's module path, for every adapted layer.

        PEFT names a layer by its path in the model it was trained on: a bare encoder
        (``encoder.layer.0.attention.self.query``), a model with a head (``bert.encoder...``)
        or a sentence-transformers model (``0.auto_model.encoder...``). The longest suffix
        of it that names a linear layer here, with the backbone's prefix if needed, is the
        layer; a path that names none refuses the adapter."""
        modules = dict(self.model.named_modules())
        prefix = getattr(self.model, "base_model_prefix", "") or ""
        out: dict[str, str] = {}
        for path, lora in data.modules.items():
            parts = path.split(".")
            found = None
            for start in range(len(parts)):
                tail = ".".join(parts[start:])
                for name in (tail, f"{prefix}.{tail}" if prefix else tail):
                    module = modules.get(name)
                    if module is not None and isinstance(_inner(module), torch.nn.Linear):
                        found = name
                        break
                if found:
                    break
            if found is None:
                raise LoraFileError(f"{data.name}: layer {path} is not a linear layer of "
                                    f"model {self.config.id}")
            layer = _inner(modules[found])
            if (layer.in_features, layer.out_features) != (lora.a.shape[1], lora.b.shape[0]):
                raise LoraFileError(
                    f"{data.name}: {path} is {lora.a.shape[1]} -> {lora.b.shape[0]}, the "
                    f"model's {found} {layer.in_features} -> {layer.out_features}")
            if found in out.values():
                raise LoraFileError(f"{data.name}: two layers of the adapter map to {found}")
            out[path] = found
        return out

    def _saved_targets(self, data: LoraFile) -> dict[str, str]:
        """PEFT module path -> the serving model's module path, for every module the
        adapter saved whole: the longest suffix that names a module here (as ``_targets``)
        whose parameters and buffers have the saved names and shapes."""
        modules = dict(self.model.named_modules())
        prefix = getattr(self.model, "base_model_prefix", "") or ""
        out: dict[str, str] = {}
        for path, state in data.saved.items():
            parts = path.split(".")
            tails = (".".join(parts[start:]) for start in range(len(parts)))
            found = next((name for tail in tails
                          for name in (tail, f"{prefix}.{tail}" if prefix else tail)
                          if name in modules), None)
            if found is None:
                raise LoraFileError(f"{data.name}: module {path} (modules_to_save) is not a "
                                    f"module of model {self.config.id}")
            if found in out.values():
                raise LoraFileError(f"{data.name}: two saved modules map to {found}")
            # Heron's own wrappers inside it are not the checkpoint's: compare without them.
            have = {k: tuple(v.shape) for k, v in _plain_copy(
                modules[found], self).state_dict().items()}
            want = {k: tuple(v.shape) for k, v in state.items()}
            if have != want:
                raise LoraFileError(
                    f"{data.name}: module {path} (modules_to_save) does not fit the model's "
                    f"{found}: saved {sorted(want.items())[:4]}, model "
                    f"{sorted(have.items())[:4]}")
            out[path] = found
        return out

    def _install(self, name: str, source: WeightSource, data: LoraFile,
                 paths: dict[str, str], saved_paths: dict[str, str],
                 started: float) -> LoraWeights:
        """On an inference thread, while no pass runs (the gate): tensors on the model's
        device and dtype, and a wrapper around each adapted layer, and each module saved
        whole, that has none yet."""
        with self._gate.change():
            return self._install_now(name, source, data, paths, saved_paths, started)

    def _install_now(self, name: str, source: WeightSource, data: LoraFile,
                     paths: dict[str, str], saved_paths: dict[str, str],
                     started: float) -> LoraWeights:
        modules = {}
        nbytes = 0
        saved = {}
        for path, state in data.saved.items():
            target = saved_paths[path]
            copied = _plain_copy(self.model.get_submodule(target), self).eval()
            try:  # into the copy's own tensors: the model's device and dtype
                copied.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
            except RuntimeError as exc:
                raise LoraFileError(f"{data.name}: module {path}: {exc}") from exc
            saved[target] = copied
            nbytes += sum(t.numel() * t.element_size() for t in copied.state_dict().values())
        device = self._adapter.device
        # The model's weights dtype (fp16 on CUDA; fp32 on CPU, where autocast casts).
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()),
                     torch.float32)
        for path, lora in data.modules.items():
            target = paths[path]
            a = torch.from_numpy(lora.a).to(device, dtype)
            b = (torch.from_numpy(lora.b).float() * lora.scale).to(device, dtype)
            modules[target] = (a, b)
            nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
            if target not in self._wrapped:
                self._wrap(target)
        for target in saved:
            if target not in self._swapped:
                parent, child = self._parent(target)
                self._swapped[target] = LoraSwap(getattr(parent, child), target, self)
                setattr(parent, child, self._swapped[target])
        return LoraWeights(name, source, modules, nbytes, time.monotonic() - started, saved)

    def _parent(self, target: str) -> tuple[torch.nn.Module, str]:
        parent_name, _, child = target.rpartition(".")
        return (self.model.get_submodule(parent_name) if parent_name else self.model), child

    def _wrap(self, target: str) -> None:
        parent, child = self._parent(target)
        while isinstance(getattr(parent, child), LoraSwap):  # a saved module's base
            parent, child = getattr(parent, child), "base"
        base = getattr(parent, child)
        assert isinstance(base, torch.nn.Linear)
        wrapper = LoraLinear(base, target, self)
        setattr(parent, child, wrapper)
        self._wrapped[target] = wrapper

    # ---- forward side (inference thread) --------------------------------------------------
    def run(self, items: list[Any], loras: list[Any] | None,
            compute: Callable[[list[Any], list[Any] | None], list[Any]]) -> list[Any]:
        """``compute(items, loras)`` (collate, forward with ``applied``, postprocess) in one
        pass; or, for a batch that mixes an unmixable adapter with others, one pass per
        adapter, the values put back in the items' order."""
        distinct = list({id(x): x for x in loras or ()}.values())
        if len(distinct) <= 1:
            return compute(items, loras)
        if not any(x is not None and x.unmixable for x in distinct):
            try:
                return compute(items, loras)
            except _Unmixable:
                pass
        out: list[Any] = [None] * len(items)
        for lora in distinct:
            index = [i for i, x in enumerate(loras or ()) if x is lora]
            for i, value in zip(index, compute([items[i] for i in index], [lora] * len(index)),
                                strict=True):
                out[i] = value
        return out

    @contextlib.contextmanager
    def applied(self, batch: Any, loras: list[Any] | None) -> Iterator[None]:
        """Compute the batch with each row's adapter (``loras[i]``: item i's, or None).
        Raises _Unmixable after the forward pass if some rows came out wrong."""
        groups = self._groups(batch, loras) if loras else []
        if not groups:
            yield
            return
        active = self._batch.active = ActiveLoras(groups)
        try:
            yield
        finally:
            self._batch.active = None
        if active.mismatch:
            raise _Unmixable

    def _groups(self, batch: Any, loras: list[Any]) -> list[_Group]:
        distinct = list({id(lora): lora for lora in loras if lora is not None}.values())
        if not distinct:
            return []
        if len(distinct) == 1 and all(lora is distinct[0] for lora in loras):
            return [_Group(distinct[0], None, None)]
        device = batch.input_ids.device
        groups = []
        for lora in distinct:
            rows = torch.tensor([x is lora for x in loras], dtype=torch.bool, device=device)
            packing = getattr(batch, "packing", None)
            if packing is not None:  # [1, T]: real tokens by item, then bucket padding
                tokens = torch.zeros(batch.input_ids.shape, dtype=torch.bool, device=device)
                real = packing.segment_ids.numel()
                tokens[0, :real] = rows[packing.segment_ids]
            else:  # [B, L]: every position of the item's row
                tokens = rows.unsqueeze(1).expand(batch.input_ids.shape).contiguous()
            groups.append(_Group(lora, tokens, rows))
        return groups
