"""The adapter contract: load, tokenize, forward, postprocess.

An adapter knows one model family. It never sees requests, queues or HTTP: the runner
tokenizes through it, batches by token count, calls ``forward`` on its inference thread and
hands each item's ``postprocess`` output back to the request that owns it.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.tokenization_utils_base import PaddingStrategy, TruncationStrategy

from heron.runtime.adapters import adapter_family
from heron.runtime.checkpoint import Checkpoint, CheckpointError
from heron.runtime.modelconfig import ModelConfig, Profile
from heron.worker.adapters import packing
from heron.worker.adapters.cuda_graphs import GraphedBert, cuda_graphs_enabled
from heron.worker.adapters.packing import Packing
from heron.worker.adapters.plain_bert import PlainBert
from heron.worker.adapters.special_tokens import special_tokens_around
from heron_sdk.errors import HeronError

# Model types whose position ids are offset by padding_idx + 1 (transformers'
# create_position_ids_from_input_ids).
PADDING_OFFSET_POSITIONS = frozenset({"roberta", "xlm-roberta", "camembert", "mpnet",
                                      "xlm-roberta-xl", "data2vec-text"})



@dataclass(frozen=True, slots=True)
class TokenIds:
    """A text given as the model's own token ids, without special tokens (OpenAI's token-id
    input): tokenizing puts the checkpoint's special tokens around them."""

    ids: tuple[int, ...]


# A text, a (query, document) pair for cross-encoders, or token ids.
TextInput = str | tuple[str, str] | TokenIds
# Request input types that name a prompt of their own in a checkpoint's
# config_sentence_transformers.json (heron_sdk.types.INPUT_TYPES; the others are a side).
NAMED_PROMPT_TYPES = frozenset({"classification", "clustering"})


@dataclass(slots=True)
class Tokenized:
    """One item after tokenization: what the batcher counts and the model consumes."""

    input_ids: list[int]
    token_type_ids: list[int] | None
    truncated: bool
    text: str = ""
    offsets: list[tuple[int, int]] | None = None
    special_mask: list[int] | None = None
    query: bool = False  # tokenized as a query (ColBERT marks and expands queries)
    prompt_tokens: int = 0  # leading tokens pooling leaves out (a Pooling without include_prompt)

    @property
    def length(self) -> int:
        return len(self.input_ids)


@dataclass(slots=True)
class RefusedItem(Tokenized):
    """An item its model could not take (a corrupt image): its 4xx, and no cost. Encode
    answers it as the item's error and computes its neighbours."""

    error: HeronError | None = None


@dataclass(slots=True)
class Batch:
    items: list[Tokenized]
    input_ids: torch.Tensor  # [B, L], right-padded
    attention_mask: torch.Tensor  # [B, L]
    token_type_ids: torch.Tensor | None
    lengths: torch.Tensor  # [B]
    # Packed batches ([1, T], no padding, attention_mask None) carry where items lie.
    packing: Packing | None = None
    position_ids: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, Any]:
        inputs: dict[str, Any] = {"input_ids": self.input_ids}
        if self.packing is not None:
            inputs["position_ids"] = self.position_ids
            inputs["heron_attention_groups"] = self.packing.attention
        else:
            inputs["attention_mask"] = self.attention_mask
        if self.token_type_ids is not None:
            inputs["token_type_ids"] = self.token_type_ids
        return inputs


class Adapter(ABC):
    """Base of every model family. Subclasses set ``name`` (their entry in the adapter
    table, heron/runtime/adapters.py, which gives ``tasks``, ``task`` and ``output_types``),
    the optional flags below, and implement ``load_model``, ``forward`` and ``postprocess``."""

    name: ClassVar[str]
    tasks: ClassVar[tuple[str, ...]]  # from the table: the calls its models answer
    task: ClassVar[str]  # from the table: "encode" | "score" | "extract", what forward computes
    output_types: ClassVar[frozenset[str]]  # from the table: what encode produces
    needs_offsets: ClassVar[bool] = False
    needs_special_mask: ClassVar[bool] = False
    supports_packing: ClassVar[bool] = False  # forward/postprocess handle Batch.packing
    # Encode takes token ids in place of a text (its tokenization is the base class's).
    accepts_token_ids: ClassVar[bool] = True
    # Encode and score take image items (heron.worker.images.ImageInput in ``tokenize``).
    accepts_images: ClassVar[bool] = False
    # Answers may come from the worker's result cache (heron.worker.result_cache).
    cacheable: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # One source of truth: the torch-free gateway routes by the same table entry.
        super().__init_subclass__(**kwargs)
        family = adapter_family(cls.name)
        cls.tasks, cls.task, cls.output_types = family.tasks, family.task, family.output_types

    def __init__(self, config: ModelConfig, profile: Profile,
                 checkpoint: Checkpoint | None = None) -> None:
        self.config = config
        self.profile = profile
        # What the files say (pooling, prompts, heads...); a profile field that is set wins.
        self.checkpoint = checkpoint or Checkpoint(path=Path("."))
        self.tokenizer: PreTrainedTokenizerBase
        self.model: torch.nn.Module
        self.device = torch.device("cpu")
        self.max_length = 512
        self.hidden_size = 0
        self.packed = False
        self.packing_refused: str | None = None  # why this model pads (logged, described)
        self.dimensions: int | None = None  # of its dense output, once loaded
        self.lowercase = False
        self._prompt_lengths: dict[str, int] = {}
        self._prompt_token_ids: dict[str, tuple[int, ...]] = {}
        # The special tokens around a single text, and whether the tokenizer gives
        # token_type_ids (found on first use: _special_tokens).
        self._specials: list[list[int]] | None = None
        self._uses_type_ids = False
        self._tokenize_lock = threading.Lock()

    # ---- load ------------------------------------------------------------------------
    @property
    def remote_code(self) -> dict[str, Any]:
        """from_pretrained's trust_remote_code, as the model's config allows."""
        return {"trust_remote_code": self.config.trust_remote_code}

    def load_with_head(self, auto_class: Any, path: Path) -> torch.nn.Module:
        """``auto_class.from_pretrained(path)`` (an AutoModelFor* class: a backbone and a
        task head) that refuses a checkpoint lacking weights of that model.

        transformers fills weights missing from the files with random ones and only warns
        (a base BertModel loaded as a sequence classifier gets a random ``classifier``):
        served, that model answers noise as if right. Its own loading info lists what it
        initialized (tied weights and keys a model declares optional are not listed)."""
        model, info = auto_class.from_pretrained(str(path), output_loading_info=True,
                                                 **self.remote_code)
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more"
                                              if len(missing) > 8 else "")
            raise CheckpointError(
                f"the checkpoint lacks weights the {self.name} adapter's "
                f"{type(model).__name__} needs: {shown} would be newly initialized (random "
                f"outputs). Point the model at a checkpoint trained for this task (with its "
                f"head), or pick the adapter its files are for")
        return model

    def load(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        path = self.checkpoint.backbone or path  # a Router keeps its transformer in a folder
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), **self.remote_code)
            model = self.load_model(path)
        except CheckpointError:
            raise  # a ValueError too, but already says what is wrong
        except ValueError as exc:
            if self.checkpoint.remote_code and not self.config.trust_remote_code:
                raise CheckpointError(
                    f"the checkpoint ships its own modelling code (config.json auto_map) that "
                    f"transformers needs to load it; set trust_remote_code: true in the model's "
                    f"config if you trust that code (docs/models.md) ({exc})") from exc
            raise
        self.model = model.to(device=device, dtype=dtype).eval()
        self.device = device
        self.packed = False
        if self.supports_packing:
            self.packing_refused = (packing.refusal(model, device, self.profile.packing)
                                    or self.packing_refusal())
            self.packed = self.packing_refused is None
        else:
            self.packing_refused = f"the {self.name} adapter pads its batches"
        self.plain_bert: PlainBert | None = None
        self.graphed_bert: GraphedBert | None = None
        if self.packed:
            packing.enable(model)
            self.plain_bert = PlainBert.build(model)
        elif device.type == "cuda" and cuda_graphs_enabled(os.environ):
            plain = PlainBert.build(model)
            self.graphed_bert = None if plain is None else GraphedBert(plain, device)
        model_limit = getattr(model.config, "max_position_embeddings", None) or 512
        if getattr(model.config, "model_type", None) in PADDING_OFFSET_POSITIONS:
            # Their positions start after padding_idx: XLM-R's 514 positions hold 512 tokens.
            model_limit -= int(getattr(model.config, "pad_token_id", 1) or 1) + 1
        tokenizer_limit = self.tokenizer.model_max_length
        if not tokenizer_limit or tokenizer_limit > 1_000_000:
            tokenizer_limit = model_limit
        limit = min(model_limit, tokenizer_limit)
        # sentence-transformers' max_seq_length is what its encode truncates at.
        wanted = self.profile.max_sequence_length or self.checkpoint.max_seq_length or limit
        self.max_length = min(wanted, model_limit)
        self.hidden_size = int(getattr(model.config, "hidden_size", 0) or 0)
        self.lowercase = self.checkpoint.do_lower_case

    def packing_refusal(self) -> str | None:
        """Why this checkpoint cannot be packed though its family packs; None: it can."""
        return None

    def prompt(self, query: bool, override: str | None = None,
               input_type: str | None = None) -> str:
        """The text put before each input: the request's instruction, else the checkpoint's
        prompt named by ``input_type`` (classification, clustering) when it has one, else
        the profile's, else the checkpoint's own prompts as sentence-transformers'
        encode_query and encode_document choose them ("query"; "document", "passage" or
        "corpus"; else the default prompt)."""
        if override is not None:
            return override
        if input_type in NAMED_PROMPT_TYPES and input_type in self.checkpoint.prompts:
            return self.checkpoint.prompts[input_type]
        configured = (self.profile.query_instruction if query
                      else self.profile.document_instruction)
        if configured is not None:
            return configured
        return self.checkpoint_prompt(query)

    def checkpoint_prompt(self, query: bool) -> str:
        """The prompt the checkpoint's own files give a query or a document."""
        prompts = self.checkpoint.prompts
        names = ("query",) if query else ("document", "passage", "corpus")
        for name in names:
            if name in prompts:
                return prompts[name]
        default = self.checkpoint.default_prompt_name
        return prompts.get(default, "") if default else ""

    def extract_inputs(self, texts: list[str], labels: list[str] | None,
                       threshold: float) -> list[TextInput]:
        """What ``tokenize`` gets for ``extract``: the texts, where labels and threshold only
        filter the answer; a zero-shot family puts them into its inputs (gliner)."""
        return list(texts)

    def describe(self) -> dict[str, Any]:
        """What GET /v1/models/{id} shows of the loaded model: what the checkpoint said, and
        what the profile made of it."""
        out: dict[str, Any] = {"adapter": self.name, "task": self.task, "tasks": list(self.tasks),
                               "output_types": sorted(self.output_types),
                               "max_sequence_length": self.max_length, "packed": self.packed,
                               "detected": self.checkpoint.summary()}
        if self.dimensions:
            out["dimensions"] = self.dimensions
        if self.packing_refused and self.supports_packing:
            out["packing_refused"] = self.packing_refused
        prompts = {"query": self.prompt(True), "document": self.prompt(False)}
        if any(prompts.values()):
            out["prompts"] = prompts
        return out

    def store_matmul_weights(self, dtype: torch.dtype) -> None:
        """Keep Linear layers' weights in ``dtype``, the autocast dtype they compute in.

        Autocast casts fp32 weights to bf16 on every forward pass (12% of MiniLM's bf16
        forward time on the CI machine); stored in bf16 they cast once, and the results are
        bit-identical because autocast would have made the same values. Norms and
        embeddings stay fp32, as autocast runs them."""
        for module in self.model.modules():
            if isinstance(module, torch.nn.Linear):
                module.to(dtype)

    def release(self) -> None:
        """Drop the weights (eviction); the tokenizer stays for requests already past it."""
        if hasattr(self, "model"):
            del self.model
        self.plain_bert = None
        self.graphed_bert = None

    @abstractmethod
    def load_model(self, path: Path) -> torch.nn.Module: ...

    # ---- tokenize (runs on the tokenizer thread pool) --------------------------------
    def tokenize(self, inputs: list[TextInput], query: bool = False,
                 prompt: str = "") -> list[Tokenized]:
        """Tokenize ``prompt`` + each text with truncation at max_length; items that did not
        fit are flagged."""
        # A fast tokenizer keeps truncation settings as mutable state that every call
        # rewrites, so two threads with different max_length corrupt each other's results
        # (or fail with "Already borrowed"). One call at a time per model.
        with self._tokenize_lock:
            return self._tokenize_prompted(inputs, query, prompt)

    def _tokenize_prompted(self, inputs: list[TextInput], query: bool,
                           prompt: str) -> list[Tokenized]:
        if prompt:
            inputs = [prompt + x if isinstance(x, str)
                      else TokenIds((*self._prompt_ids(prompt), *x.ids))
                      if isinstance(x, TokenIds) else x for x in inputs]
        out = self._tokenize_locked(inputs, query)
        if prompt and not self.checkpoint.pooling_include_prompt:
            # sentence-transformers pools without the prompt's tokens ([CLS] and the prompt,
            # not a special token that closes it) when its Pooling says include_prompt false.
            count = self._prompt_lengths.get(prompt)
            if count is None:
                ids = self._tokenize_locked([prompt], query)[0].input_ids
                count = len(ids) - (1 if ids and ids[-1] in self.tokenizer.all_special_ids
                                    else 0)
                self._prompt_lengths[prompt] = count
            for t in out:
                t.prompt_tokens = count
        return out

    def _prompt_ids(self, prompt: str) -> tuple[int, ...]:
        ids = self._prompt_token_ids.get(prompt)
        if ids is None:
            ids = tuple(self.tokenizer(prompt.lower() if self.lowercase else prompt,
                                       add_special_tokens=False)["input_ids"])
            self._prompt_token_ids[prompt] = ids
        return ids

    def _tokenize_locked(self, inputs: list[TextInput], query: bool) -> list[Tokenized]:
        if self.lowercase:  # sentence_bert_config.json do_lower_case, as ST applies it
            inputs = [x.lower() if isinstance(x, str) else x if isinstance(x, TokenIds)
                      else (x[0].lower(), x[1].lower()) for x in inputs]
        out = self._encode(inputs, self.max_length + 1)
        too_long = [i for i, t in enumerate(out) if t.length > self.max_length]
        if too_long:
            again = self._encode([inputs[i] for i in too_long], self.max_length)
            for i, t in zip(too_long, again, strict=True):
                t.truncated = True
                out[i] = t
        for t in out:
            t.query = query
        return out

    def tokenize_now(self, inputs: list[TextInput], query: bool = False,
                     prompt: str = "") -> list[Tokenized] | None:
        """Tokenize on the calling thread if nobody else is tokenizing for this model (a
        short request costs ~40 us to tokenize, less than the hop to a pool thread and
        back); None if another thread holds the tokenizer."""
        if not self._tokenize_lock.acquire(blocking=False):
            return None
        try:
            return self._tokenize_prompted(inputs, query, prompt)
        finally:
            self._tokenize_lock.release()

    def clip(self, texts: list[str], max_tokens: int) -> tuple[list[str], set[int]]:
        """Each text cut after its first ``max_tokens`` tokens (special tokens not counted),
        at the character where that token ends, and the indices of the texts that were cut
        (Cohere's max_tokens_per_doc: a document's own budget, before a pair is built)."""
        with self._tokenize_lock:
            enc = self.tokenizer(
                [t.lower() for t in texts] if self.lowercase else texts,
                add_special_tokens=False, truncation=False, return_attention_mask=False,
                return_offsets_mapping=self.tokenizer.is_fast)
        out, cut = list(texts), set()
        for i, ids in enumerate(enc["input_ids"]):
            if len(ids) <= max_tokens:
                continue
            cut.add(i)
            if self.tokenizer.is_fast and len(texts[i]) == len(
                    texts[i].lower() if self.lowercase else texts[i]):
                out[i] = texts[i][: enc["offset_mapping"][i][max_tokens - 1][1]]
            else:  # no character offsets: the kept tokens, decoded
                out[i] = self.tokenizer.decode(ids[:max_tokens])
        return out, cut

    def _encode(self, inputs: list[TextInput], max_length: int) -> list[Tokenized]:
        given = [i for i, x in enumerate(inputs) if isinstance(x, TokenIds)]
        if not given:
            return self._encode_texts(inputs, max_length)
        out: list[Tokenized | None] = [None] * len(inputs)
        texts = [i for i, x in enumerate(inputs) if not isinstance(x, TokenIds)]
        if texts:
            for i, t in zip(texts, self._encode_texts([inputs[i] for i in texts], max_length),
                            strict=True):
                out[i] = t
        head, tail = self._special_tokens()
        room = max(0, max_length - len(head) - len(tail))
        for i in given:
            ids = inputs[i].ids  # type: ignore[union-attr]
            full = [*head, *ids[:room], *tail]
            out[i] = Tokenized(input_ids=full, truncated=False,
                               token_type_ids=[0] * len(full) if self._uses_type_ids else None)
        return out  # type: ignore[return-value]

    def _special_tokens(self) -> tuple[list[int], list[int]]:
        if self._specials is None:
            *self._specials, self._uses_type_ids = special_tokens_around(self.tokenizer)
        return self._specials  # type: ignore[return-value]

    @property
    def vocab_size(self) -> int:
        """Token ids from 0 to this (exclusive) are the model's (added tokens included)."""
        return len(self.tokenizer)

    def _encode_texts(self, inputs: list[TextInput], max_length: int) -> list[Tokenized]:
        pairs = bool(inputs) and isinstance(inputs[0], tuple)
        if not (pairs or self.needs_offsets or self.needs_special_mask) and self.tokenizer.is_fast:
            return self._encode_plain(inputs, max_length)  # type: ignore[arg-type]
        kwargs: dict[str, Any] = {
            "truncation": "only_second" if pairs else True,
            "max_length": max_length,
            "return_offsets_mapping": self.needs_offsets,
            "return_special_tokens_mask": self.needs_special_mask,
            "return_attention_mask": False,
        }
        if pairs:
            queries, docs = [p[0] for p in inputs], [p[1] for p in inputs]
            try:
                enc = self.tokenizer(queries, docs, **kwargs)
            except Exception:
                # The query alone is over the limit: cut both sides rather than fail.
                enc = self.tokenizer(queries, docs, **{**kwargs, "truncation": "longest_first"})
        else:
            enc = self.tokenizer(list(inputs), **kwargs)
        type_ids = enc.get("token_type_ids")
        offsets = enc.get("offset_mapping")
        special = enc.get("special_tokens_mask")
        return [
            Tokenized(
                input_ids=ids,
                token_type_ids=type_ids[i] if type_ids is not None else None,
                truncated=False,
                text=inputs[i] if isinstance(inputs[i], str) else inputs[i][1],
                offsets=[tuple(o) for o in offsets[i]] if offsets is not None else None,
                special_mask=special[i] if special is not None else None,
            )
            for i, ids in enumerate(enc["input_ids"])
        ]

    def _encode_plain(self, texts: list[str], max_length: int) -> list[Tokenized]:
        """Single texts needing no character offsets: the Rust tokenizer's
        ``encode_batch_fast`` (offsets not computed) after transformers sets its truncation
        exactly as its own call would, without transformers' conversion of every encoding.
        MiniLM, 134-character texts, 9 a call: 39 us a text against 51 (encode's whole
        tokenize step on a worker)."""
        tok = self.tokenizer
        tok.set_truncation_and_padding(  # type: ignore[attr-defined]
            padding_strategy=PaddingStrategy.DO_NOT_PAD,
            truncation_strategy=TruncationStrategy.LONGEST_FIRST, max_length=max_length,
            stride=0, pad_to_multiple_of=None, padding_side=None)
        backend = tok.backend_tokenizer  # type: ignore[attr-defined]
        split = getattr(tok, "split_special_tokens", False)
        if backend.encode_special_tokens != split:
            backend.encode_special_tokens = split
        with_type_ids = "token_type_ids" in tok.model_input_names
        return [Tokenized(input_ids=enc.ids, token_type_ids=enc.type_ids if with_type_ids
                          else None, truncated=False, text=text)
                for text, enc in zip(texts, backend.encode_batch_fast(texts), strict=True)]

    # ---- collate, forward, postprocess (inference thread) -----------------------------
    def collate(self, items: list[Tokenized]) -> Batch:
        return self._collate_packed(items) if self.packed else self._collate_padded(items)

    def _collate_packed(self, items: list[Tokenized]) -> Batch:
        lengths = np.fromiter((t.length for t in items), dtype=np.int64, count=len(items))
        starts = np.zeros(len(items), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        real = int(lengths.sum())
        total = packing.bucketed_length(real)
        pad_id = self.tokenizer.pad_token_id or 0
        ids = np.full(total, pad_id, dtype=np.int64)
        ids[:real] = np.fromiter((i for t in items for i in t.input_ids), dtype=np.int64,
                                 count=real)
        positions = np.arange(total, dtype=np.int64)
        positions[:real] -= np.repeat(starts, lengths)
        # The padding may be longer than the model has positions: all position 0.
        positions[real:] = 0
        types = None
        if items[0].token_type_ids is not None:
            types = np.zeros(total, dtype=np.int64)
            types[:real] = np.fromiter(
                (i for t in items for i in (t.token_type_ids or [0] * t.length)),
                dtype=np.int64, count=real)
        to = self.device
        segment_ids = torch.from_numpy(np.repeat(np.arange(len(items)), lengths)).to(to)
        segments = [(int(s), int(s + n)) for s, n in zip(starts, lengths, strict=True)]
        layout = Packing(segments=segments, starts=torch.from_numpy(starts).to(to),
                         segment_ids=segment_ids,
                         attention=packing.attention_groups(segments, to))
        return Batch(items=items, input_ids=torch.from_numpy(ids).to(to).unsqueeze(0),
                     attention_mask=torch.ones(1, total, dtype=torch.int64, device=to),
                     token_type_ids=None if types is None else
                     torch.from_numpy(types).to(to).unsqueeze(0),
                     lengths=torch.from_numpy(lengths).to(to), packing=layout,
                     position_ids=torch.from_numpy(positions).to(to).unsqueeze(0))

    def _collate_padded(self, items: list[Tokenized]) -> Batch:
        lengths = np.fromiter((t.length for t in items), dtype=np.int64, count=len(items))
        width = int(lengths.max())
        pad_id = self.tokenizer.pad_token_id or 0
        ids = np.full((len(items), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(items), width), dtype=np.int64)
        types = None if items[0].token_type_ids is None else np.zeros_like(ids)
        for row, t in enumerate(items):
            ids[row, : t.length] = t.input_ids
            mask[row, : t.length] = 1
            if types is not None and t.token_type_ids is not None:
                types[row, : t.length] = t.token_type_ids
        to = self.device
        return Batch(
            items=items,
            input_ids=torch.from_numpy(ids).to(to),
            attention_mask=torch.from_numpy(mask).to(to),
            token_type_ids=None if types is None else torch.from_numpy(types).to(to),
            lengths=torch.from_numpy(lengths).to(to),
        )

    def hidden_states(self, batch: Batch) -> torch.Tensor:
        """The encoder's last hidden states: [B, L, H] padded, [1, T, H] packed. While
        Heron's plain BERT path applies (adapters/plain_bert.py), a packed batch runs it and
        a padded one on CUDA replays its captured graph (adapters/cuda_graphs.py)."""
        if batch.packing is not None and self.plain_bert is not None \
                and self.plain_bert.usable():
            return self.plain_bert.states(batch.input_ids, batch.token_type_ids,
                                           batch.position_ids, batch.packing)
        graphed = self.graphed_bert
        if batch.packing is None and graphed is not None and graphed.plain.usable():
            states = graphed.states(batch.input_ids, batch.token_type_ids,
                                    batch.attention_mask)
            if states is not None:
                return states
        return self.model(**batch.model_inputs()).last_hidden_state

    @abstractmethod
    def forward(self, batch: Batch) -> Any:
        """Run the model on a padded batch; called under torch.inference_mode()."""

    @abstractmethod
    def postprocess(self, batch: Batch, output: Any) -> list[Any]:
        """Per-item results (numpy/Python values), in batch order."""

    def similarity(self, outputs: list[dict[str, Any]]) -> list[float]:
        """``score`` for an encoder: the query's output (first) against each document's, by
        the checkpoint's similarity function as sentence-transformers computes it (cosine
        unless it names dot, euclidean or manhattan)."""
        vectors = np.stack([o["dense"] for o in outputs]).astype(np.float64)
        query, docs = vectors[0], vectors[1:]
        kind = self.checkpoint.similarity or "cosine"
        if kind == "dot":
            scores = docs @ query
        elif kind == "euclidean":
            scores = -np.linalg.norm(docs - query, axis=-1)
        elif kind == "manhattan":
            scores = -np.abs(docs - query).sum(axis=-1)
        else:
            norms = np.maximum(np.linalg.norm(vectors, axis=-1), 1e-12)
            scores = (docs @ query) / (norms[1:] * norms[0])
        return scores.astype(float).tolist()


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(device="cpu", dtype=torch.float32).numpy()
