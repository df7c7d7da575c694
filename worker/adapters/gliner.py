"""Zero-shot ``extract`` with GLiNER span models, without the gliner package.

The request's labels are the model's prompt: each text's words go after
``<<ENT>> label1 <<ENT>> label2 <<SEP>>``, so rows with different label sets share one padded
batch. The encoder's ``<<ENT>>`` states are the label vectors; every span of up to
``max_width`` words gets a vector from its first and last word (gliner's ``markerV0``), and a
span's score for a label is the sigmoid of their dot product. Decoding is gliner's greedy flat
decoding: spans over the threshold, best first, none overlapping.

This reads the checkpoint that gliner's ``save_pretrained`` writes (``gliner_config.json``,
``pytorch_model.bin`` or ``model.safetensors``, the tokenizer) for the architecture gliner
builds by default: a uni-encoder span model. Other GLiNER variants (bi-encoder, token-level,
decoders, relations, other span modes) are refused at load rather than served differently.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
from transformers import AutoConfig, AutoModel, PretrainedConfig

from heron.runtime.checkpoint import CheckpointError
from heron.worker.adapters.base import Adapter, Batch, TextInput, Tokenized
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.types import MAX_LABELS, Entity

CONFIG_FILE = "gliner_config.json"
# gliner's whitespace word splitter: words (with inner - and _) and single other characters.
WORD_PATTERN = re.compile(r"\w+(?:[-_]\w+)*|\S")
# The labels warm-up runs with (the runner warms every model with one text).
WARM_UP_LABELS = ("entity",)
# Encoder families gliner builds with a class other than AutoModel's (T5's encoder alone,
# llm2vec decoders): AutoModel would build another model, so they are refused.
UNSERVED_BACKBONES = frozenset({"t5", "mt5", "llama", "mistral", "gemma", "qwen2"})


@dataclass(frozen=True, slots=True)
class LabeledText:
    """One extract item for a zero-shot model: its text, the request's labels and threshold."""

    text: str
    labels: tuple[str, ...]
    threshold: float


@dataclass(slots=True)
class GlinerTokenized(Tokenized):
    """An item with its prompt: where its words are in the text and among the tokens."""

    labels: tuple[str, ...] = ()  # the prompt's labels, duplicates dropped, in order
    threshold: float = 0.5
    word_starts: list[int] = field(default_factory=list)  # character offsets of kept words
    word_ends: list[int] = field(default_factory=list)
    word_tokens: list[tuple[int, int]] = field(default_factory=list)  # (word index, token)


def _layers(hidden: int, dropout: float, out: int | None = None) -> nn.Sequential:
    """gliner's projection: Linear(4x) -> ReLU -> Dropout -> Linear (its state-dict layout)."""
    out = out or hidden
    return nn.Sequential(nn.Linear(hidden, out * 4), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(out * 4, out))


class _Holder(nn.Module):
    """A named level of the state dict (``token_rep_layer.bert_layer.model``, ...)."""


class GlinerSpanModel(nn.Module):
    """The uni-encoder span model, with gliner's parameter names so its weights load as
    saved. ``config`` is the backbone's (the base adapter reads its limits)."""

    def __init__(self, settings: dict[str, Any], backbone: nn.Module) -> None:
        super().__init__()
        self.config: PretrainedConfig = backbone.config
        hidden = int(settings["hidden_size"])
        dropout = float(settings.get("dropout", 0.4))
        self.max_width = int(settings["max_width"])
        self.class_token_index = int(settings["class_token_index"])
        self.embed_ent_token = bool(settings.get("embed_ent_token", True))
        self.token_rep_layer = _Holder()
        self.token_rep_layer.bert_layer = _Holder()
        self.token_rep_layer.bert_layer.model = backbone
        if hidden != backbone.config.hidden_size:
            self.token_rep_layer.projection = nn.Linear(backbone.config.hidden_size, hidden)
        if int(settings.get("num_rnn_layers", 1)) > 0:
            self.rnn = _Holder()
            self.rnn.lstm = nn.LSTM(hidden, hidden // 2, num_layers=int(settings["num_rnn_layers"]),
                                    bidirectional=True, batch_first=True)
        self.span_rep_layer = _Holder()
        marker = self.span_rep_layer.span_rep_layer = _Holder()
        marker.project_start = _layers(hidden, dropout)
        marker.project_end = _layers(hidden, dropout)
        marker.out_project = _layers(hidden * 2, dropout, hidden)
        self.prompt_rep_layer = _layers(hidden, dropout)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                word_index: torch.Tensor, word_lengths: torch.Tensor) -> torch.Tensor:
        """Span-label probabilities [B, W, max_width, C]. ``word_index`` [B, L] holds each
        word's 1-based index on the token that represents it (0 elsewhere)."""
        encoder = self.token_rep_layer
        tokens = encoder.bert_layer.model(input_ids=input_ids,
                                          attention_mask=attention_mask).last_hidden_state
        if hasattr(encoder, "projection"):
            tokens = encoder.projection(tokens)
        rows, dim = tokens.shape[0], tokens.shape[-1]
        labels = self._label_vectors(tokens, input_ids, attention_mask)
        width = max(1, int(word_lengths.max()))
        words = tokens.new_zeros(rows, width, dim)
        at_row, at_token = torch.where(word_index > 0)
        words[at_row, word_index[at_row, at_token] - 1] = tokens[at_row, at_token]
        if hasattr(self, "rnn"):
            packed = pack_padded_sequence(words, word_lengths.clamp(min=1).cpu(),
                                          batch_first=True, enforce_sorted=False)
            words, _ = pad_packed_sequence(self.rnn.lstm(packed)[0], batch_first=True,
                                           total_length=width)
        spans = self._span_vectors(words, word_lengths)
        scores = torch.einsum("BLKD,BCD->BLKC", spans, self.prompt_rep_layer(labels))
        return torch.sigmoid(scores.float())  # fp32 under bf16 autocast: fewer tied scores

    def _label_vectors(self, tokens: torch.Tensor, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor) -> torch.Tensor:
        marks = input_ids.eq(self.class_token_index) & attention_mask.gt(0)
        counts = marks.sum(-1)
        out = tokens.new_zeros(tokens.shape[0], max(1, int(counts.max())), tokens.shape[-1])
        at_row, at_token = torch.where(marks)
        slot = torch.arange(out.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        taken_row, taken_slot = torch.where(slot < counts.unsqueeze(-1))
        if not self.embed_ent_token:  # the label's first token, not the marker
            at_token = at_token + 1
        out[taken_row, taken_slot] = tokens[at_row, at_token]
        return out

    def _span_vectors(self, words: torch.Tensor, word_lengths: torch.Tensor) -> torch.Tensor:
        rows, width, dim = words.shape
        k = self.max_width
        starts = torch.arange(width, device=words.device).repeat_interleave(k)
        ends = starts + torch.arange(k, device=words.device).repeat(width)
        # Spans past a row's last word point at word 0, as gliner's masked span_idx does.
        valid = ends.unsqueeze(0) < word_lengths.unsqueeze(-1)
        start_idx = torch.where(valid, starts.unsqueeze(0), 0)
        end_idx = torch.where(valid, ends.unsqueeze(0), 0)
        marker = self.span_rep_layer.span_rep_layer
        start_rep = torch.gather(marker.project_start(words), 1,
                                 start_idx.unsqueeze(-1).expand(-1, -1, dim))
        end_rep = torch.gather(marker.project_end(words), 1,
                               end_idx.unsqueeze(-1).expand(-1, -1, dim))
        joined = torch.cat([start_rep, end_rep], dim=-1).relu()
        return marker.out_project(joined).view(rows, width, k, dim)


class GlinerAdapter(Adapter):
    name = "gliner"
    accepts_token_ids = False

    def load_model(self, path: Path) -> torch.nn.Module:
        settings = _read_settings(path)
        self.settings = settings
        self.max_words = int(settings.get("max_len", 384))
        self.ent_token = str(settings.get("ent_token", "<<ENT>>"))
        self.sep_token = str(settings.get("sep_token", "<<SEP>>"))
        tokenizer = self.tokenizer
        # As gliner sets its tokenizer up: bos/eos where the tokenizer defines them, and a
        # pad token from eos where it has none.
        if hasattr(tokenizer, "add_bos_token") and tokenizer.bos_token_id is not None:
            tokenizer.add_bos_token = True
        if hasattr(tokenizer, "add_eos_token") and tokenizer.eos_token_id is not None:
            tokenizer.add_eos_token = True
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        if tokenizer.convert_tokens_to_ids(self.ent_token) != int(settings["class_token_index"]):
            raise CheckpointError(f"{CONFIG_FILE}: class_token_index "
                                  f"{settings['class_token_index']} is not the tokenizer's id "
                                  f"of {self.ent_token!r}")
        backbone_config = _backbone_config(settings)
        backbone = AutoModel.from_config(backbone_config, **self.remote_code)
        model = GlinerSpanModel(settings, backbone)
        _load_weights(model, path)
        return model

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out.update(max_labels=MAX_LABELS, max_words=self.max_words,
                   max_span_words=int(self.settings["max_width"]))
        return out

    # ---- request side --------------------------------------------------------------------
    def extract_inputs(self, texts: list[str], labels: list[str] | None,
                       threshold: float) -> list[TextInput]:
        if not labels:
            raise HeronError(ErrorCode.INVALID_FIELD,
                             f"labels: model {self.config.id} extracts the entity types a "
                             f"request names; give 1 to {MAX_LABELS} labels",
                             field="labels")
        for i, label in enumerate(labels):
            # A marker token inside a label would add a label slot of its own: the labels
            # after it would be scored against the wrong vectors.
            if self.ent_token in label or self.sep_token in label:
                raise HeronError(ErrorCode.INVALID_FIELD,
                                 f"labels[{i}]: must not contain the model's marker tokens "
                                 f"{self.ent_token} and {self.sep_token}", field=f"labels[{i}]")
        unique = tuple(dict.fromkeys(labels))  # gliner drops repeated labels, keeping order
        return [LabeledText(t, unique, threshold) for t in texts]  # type: ignore[misc]

    def _tokenize_prompted(self, inputs: list[TextInput], query: bool,
                           prompt: str) -> list[Tokenized]:
        items = [x if isinstance(x, LabeledText) else LabeledText(str(x), WARM_UP_LABELS, 0.5)
                 for x in inputs]
        out: list[Tokenized] = []
        for item in items:
            words = [(m.start(), m.end()) for m in WORD_PATTERN.finditer(item.text)]
            cut = len(words) > self.max_words
            out.append(self._fit(item, words[: self.max_words], cut))
        return out

    def _prompt(self, labels: tuple[str, ...]) -> list[str]:
        prompt: list[str] = []
        for label in labels:
            prompt += [self.ent_token, label]
        return [*prompt, self.sep_token]

    def _fit(self, item: LabeledText, words: list[tuple[int, int]],
             cut: bool) -> GlinerTokenized:
        """Tokenize the prompt and words; past the token limit, keep the words that fit
        (gliner would keep the others as words the encoder never saw)."""
        prompt = self._prompt(item.labels)
        ids, word_ids = self._encode_words(item.text, prompt, words)
        if len(ids) > self.max_length:
            last: dict[int, int] = {}  # text word -> position of its last token
            for position, word in enumerate(word_ids):
                if word is not None and word >= len(prompt):
                    last[word - len(prompt)] = position
            closing = len(ids) - 1 - max(last.values()) if last else 0  # [SEP] and such
            limit = self.max_length - closing
            keep = next((w for w in range(len(words)) if last.get(w, -1) >= limit), len(words))
            if keep == 0 or not words:
                raise HeronError(
                    ErrorCode.INVALID_FIELD,
                    f"labels: the prompt of {len(item.labels)} labels leaves no room for text "
                    f"in model {self.config.id}'s {self.max_length} tokens; use fewer or "
                    f"shorter labels", field="labels")
            words, cut = words[:keep], True
            ids, word_ids = self._encode_words(item.text, prompt, words)
        # gliner numbers words by how many distinct words it has passed (not by their index):
        # a word that gives no tokens shifts the ones after it. Done the same way here.
        seen, previous, picks = 0, None, []
        for position, word in enumerate(word_ids):
            if word is not None and word != previous:
                seen += 1
                if seen > len(prompt):
                    picks.append((seen - len(prompt), position))
            previous = word
        return GlinerTokenized(
            input_ids=ids, token_type_ids=None, truncated=cut, text=item.text,
            labels=item.labels, threshold=item.threshold,
            word_starts=[s for s, _ in words], word_ends=[e for _, e in words],
            word_tokens=picks)

    def _encode_words(self, text: str, prompt: list[str], words: list[tuple[int, int]]
                      ) -> tuple[list[int], list[int | None]]:
        enc = self.tokenizer([*prompt, *(text[s:e] for s, e in words)], is_split_into_words=True,
                             truncation=False, return_attention_mask=False,
                             return_token_type_ids=False)
        return enc["input_ids"], enc.word_ids()

    # ---- inference thread ----------------------------------------------------------------
    def forward(self, batch: Batch) -> torch.Tensor:
        items: list[GlinerTokenized] = batch.items  # type: ignore[assignment]
        word_index = torch.zeros_like(batch.input_ids)
        rows = [row for row, item in enumerate(items) for _ in item.word_tokens]
        if rows:  # one indexed write for the batch (a Python loop cost ms on long texts)
            at = [[p for item in items for _, p in item.word_tokens],
                  [w for item in items for w, _ in item.word_tokens]]
            word_index[torch.tensor(rows, device=self.device),
                       torch.tensor(at[0], device=self.device)] = torch.tensor(
                at[1], dtype=word_index.dtype, device=self.device)
        lengths = torch.tensor([len(item.word_starts) for item in items], device=self.device)
        probs = self.model(batch.input_ids, batch.attention_mask, word_index, lengths)
        return probs.float().cpu()

    def postprocess(self, batch: Batch, output: torch.Tensor) -> list[list[Entity]]:
        return [_decode(item, output[row])  # type: ignore[arg-type]
                for row, item in enumerate(batch.items)]


def _decode(item: GlinerTokenized, probs: torch.Tensor) -> list[Entity]:
    """gliner's greedy flat decoding for one row: spans over the threshold, best first, none
    overlapping another kept span, then in text order."""
    words = len(item.word_starts)
    if not words:
        return []
    probs = probs[:words, :, : len(item.labels)]
    start, width, label = torch.where(probs > item.threshold)  # row-major, as gliner finds them
    fits = start + width < words
    start, width, label = start[fits], width[fits], label[fits]
    scores = probs[start, width, label].tolist()
    candidates = sorted(zip(start.tolist(), (start + width).tolist(), label.tolist(), scores,
                            strict=True), key=lambda c: -c[3])
    kept: list[tuple[int, int, int, float]] = []
    for span in candidates:
        if all(span[0] > other[1] or other[0] > span[1] for other in kept):
            kept.append(span)
    kept.sort(key=lambda c: c[0])
    out = []
    for first, last, label_index, score in kept:
        begin, end = item.word_starts[first], item.word_ends[last]
        out.append(Entity(label=item.labels[label_index], text=item.text[begin:end],
                          start=begin, end=end, score=score))
    return out


def _read_settings(path: Path) -> dict[str, Any]:
    try:
        settings = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{CONFIG_FILE}: cannot be read: {exc}") from exc
    refusals = {
        "span_mode": settings.get("span_mode", "markerV0") != "markerV0",
        "labels_encoder": bool(settings.get("labels_encoder")),
        "labels_decoder": bool(settings.get("labels_decoder")),
        "relations_layer": settings.get("relations_layer") is not None,
        "post_fusion_schema": bool(settings.get("post_fusion_schema")),
        "fuse_layers": bool(settings.get("fuse_layers")),
        "span_encoder_config": settings.get("span_encoder_config") is not None,
        "precomputed_prompts_mode": bool(settings.get("precomputed_prompts_mode")),
        "subtoken_pooling": settings.get("subtoken_pooling", "first") != "first",
        "words_splitter_type": settings.get("words_splitter_type", "whitespace") != "whitespace",
        "model_type": settings.get("model_type") not in (None, "gliner_uni_encoder_span"),
    }
    wrong = [f"{k}={settings.get(k)!r}" for k, refused in refusals.items() if refused]
    if wrong:
        raise CheckpointError(f"{CONFIG_FILE}: Heron serves GLiNER's uni-encoder span model "
                              f"(span_mode markerV0, first-subtoken words, whitespace words); "
                              f"this one has {', '.join(wrong)}")
    if int(settings.get("class_token_index", -1)) < 0:
        raise CheckpointError(f"{CONFIG_FILE}: class_token_index is not set (the model was "
                              f"saved before its <<ENT>> token was added)")
    return settings


def _backbone_config(settings: dict[str, Any]) -> PretrainedConfig:
    values = settings.get("encoder_config")
    if not isinstance(values, dict) or "model_type" not in values:
        raise CheckpointError(f"{CONFIG_FILE}: has no encoder_config; gliner would read the "
                              f"backbone's config from {settings.get('model_name')!r} on the "
                              f"Hub. Save the model again with gliner 0.2.29, which writes it")
    values = dict(values)
    model_type = values.pop("model_type")
    if model_type in UNSERVED_BACKBONES:
        raise CheckpointError(f"{CONFIG_FILE}: a {model_type} backbone is not served")
    config = AutoConfig.for_model(model_type, **values)
    if settings.get("_attn_implementation"):
        config._attn_implementation = settings["_attn_implementation"]
    return config


def _load_weights(model: nn.Module, path: Path) -> None:
    """The saved state dict into ``model``; any weight it lacks or does not know fails the
    load (a missing one would stay random)."""
    if (path / "model.safetensors").is_file():
        from safetensors import safe_open

        state: dict[str, torch.Tensor] = {}
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            aliases = f.metadata() or {}
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                state[key] = f.get_tensor(key)
        # Tied tensors are saved once; the metadata names where the others point.
        for alias, saved in aliases.items():
            if alias not in state and saved in state:
                state[alias] = state[saved]
    elif (path / "pytorch_model.bin").is_file():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise CheckpointError("no model.safetensors or pytorch_model.bin next to "
                              f"{CONFIG_FILE}")
    result = model.load_state_dict(state, strict=False)
    unexpected = [k for k in result.unexpected_keys
                  if not k.endswith((".position_ids", ".token_type_ids"))]  # old buffers
    if result.missing_keys or unexpected:
        raise CheckpointError(f"the GLiNER weights do not fit the model its {CONFIG_FILE} "
                              f"describes: missing {result.missing_keys[:6]}, unexpected "
                              f"{unexpected[:6]}")
