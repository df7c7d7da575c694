"""What a checkpoint says about itself: read from its files, without torch.

A model config names only an id and where the weights are; how to serve them comes from
the checkpoint, as the reference libraries would read it:
- sentence-transformers (``modules.json``, ``1_Pooling/config.json``, ``2_Dense``,
  ``Normalize``, ``config_sentence_transformers.json`` prompts and similarity,
  ``sentence_bert_config.json`` max_seq_length), in the layouts of versions 2 to 6;
- CrossEncoder (``model_type`` or the ``sentence_transformers`` block of ``config.json``),
  SparseEncoder (SPLADE pooling, and the inference-free query side of a ``Router``);
- PyLate ColBERT (``config_sentence_transformers.json`` query/document settings), Stanford
  ColBERT (an ``HF_ColBERT`` config.json, ``artifact.metadata``, the ``linear.weight``
  projection inside the backbone's weights) and BGE-M3 (``colbert_linear.pt`` and
  ``sparse_linear.pt`` beside the backbone);
- transformers' own ``config.json`` (architectures, decoder model types, ``auto_map``).

``read_checkpoint`` gives a ``Checkpoint``; ``detect_family`` the adapter that serves it.
A profile field that is set overrides what is read here (heron/runtime/modelconfig.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# sentence-transformers' pooling modes, by the names its Pooling config uses.
ST_POOLINGS = ("cls", "mean", "max", "lasttoken", "weightedmean", "mean_sqrt_len_tokens")
# transformers model types that are causal decoders: last-token pooling, EOS appended.
DECODER_MODEL_TYPES = frozenset({
    "qwen2", "qwen3", "mistral", "llama", "gemma", "gemma2", "gemma3", "gemma3_text",
    "phi3", "gpt2", "gpt_neox", "olmo", "olmo2", "starcoder2", "mixtral"})


# sentence-transformers modules whose computation the adapters reproduce.
SERVED_MODULES = frozenset({"Transformer", "MLMTransformer", "Pooling", "Dense", "Normalize",
                            "SpladePooling", "Router"})
SERVED_MODULE_PACKAGES = ("sentence_transformers.", "pylate.")


class CheckpointError(ValueError):
    """The files are there but cannot be served as they say (an unknown module, a broken
    config): the model fails to load with this message rather than serve wrong vectors."""


@dataclass(frozen=True, slots=True)
class DenseLayer:
    """A sentence-transformers ``Dense`` module: ``activation(W x + b)``."""

    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str  # the last part of the torch class name: Identity, Tanh, ...


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Everything Heron reads from a model directory. None: the files do not say."""

    path: Path
    model_type: str | None = None  # transformers' config.json
    architectures: tuple[str, ...] = ()
    remote_code: bool = False  # config.json maps its classes to code shipped with it
    st_kind: str | None = None  # SentenceTransformer | CrossEncoder | SparseEncoder | ColBERT
    st_modules: tuple[str, ...] = ()  # module class names, in order
    pooling: str | None = None  # one of ST_POOLINGS
    pooling_include_prompt: bool = True
    dense_layers: tuple[DenseLayer, ...] = ()
    normalize: bool | None = None  # a Normalize module (None: not a sentence-transformers model)
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    do_lower_case: bool = False
    similarity: str | None = None  # cosine | dot | euclidean | manhattan
    num_labels: int | None = None
    activation: str | None = None  # CrossEncoder's: sigmoid | softmax | none
    splade_pooling: str | None = None  # SparseEncoder: max | sum
    inference_free_query: Path | None = None  # a Router's query-side static weights
    backbone: Path | None = None  # the transformer's folder, where it is not the root's
    colbert: dict[str, Any] | None = None  # PyLate's settings (query_prefix, lengths, ...)
    bge_m3: bool = False
    gliner: bool = False  # gliner's save_pretrained: gliner_config.json, no config.json

    @property
    def is_decoder(self) -> bool:
        return self.model_type in DECODER_MODEL_TYPES

    def summary(self) -> dict[str, Any]:
        """What GET /v1/models/{id} shows under ``detected``."""
        out: dict[str, Any] = {"format": self.st_kind or ("bge-m3" if self.bge_m3 else
                                                          "gliner" if self.gliner else
                                                          "transformers"),
                               "model_type": self.model_type}
        # PyLate normalizes ColBERT's token vectors and truncates by its own lengths.
        colbert_skips = ("normalize", "max_seq_length") if self.colbert is not None else ()
        for key in ("pooling", "normalize", "max_seq_length", "similarity", "activation",
                    "splade_pooling", "default_prompt_name"):
            if key in colbert_skips:
                continue
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.prompts:
            out["prompts"] = dict(self.prompts)
        if self.dense_layers:
            out["dense_layers"] = [[d.in_features, d.out_features, d.activation]
                                   for d in self.dense_layers]
        if self.inference_free_query is not None:
            out["inference_free_query"] = True
        if self.remote_code:
            out["remote_code"] = True
        if self.colbert is not None:
            out["colbert"] = dict(self.colbert)
        return out


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path.name}: cannot be read: {exc}") from exc


def _class_name(module_type: str) -> str:
    # ST 2-5 write "sentence_transformers.models.Pooling"; ST 6 writes the module path
    # "sentence_transformers.sentence_transformer.modules.pooling.Pooling"; PyLate writes
    # "pylate.models.Dense.Dense". The class name is what they have in common.
    return module_type.rsplit(".", 1)[-1]


def _pooling_mode(config: dict[str, Any]) -> str:
    if isinstance(config.get("pooling_mode"), str):  # ST 3+
        mode = config["pooling_mode"]
        return {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max",
                "lasttoken": "lasttoken"}.get(mode, mode)
    flags = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens":
             "mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens": "weightedmean",
             "pooling_mode_lasttoken": "lasttoken"}
    chosen = [mode for key, mode in flags.items() if config.get(key)]
    if len(chosen) != 1:
        # Several modes concatenate their vectors in ST: rare, and not served here.
        raise CheckpointError(f"1_Pooling/config.json: needs exactly one pooling mode, "
                              f"found {chosen or 'none'}")
    return chosen[0]


def _activation_name(value: Any) -> str:
    name = str(value or "Identity").rsplit(".", 1)[-1]
    return name


def _dense_layer(path: Path) -> DenseLayer:
    config = _json(path / "config.json") or {}
    try:
        return DenseLayer(path=path, in_features=int(config["in_features"]),
                          out_features=int(config["out_features"]),
                          bias=bool(config.get("bias", True)),
                          activation=_activation_name(config.get("activation_function")))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path.name}/config.json: not a Dense layer config") from exc


def _cross_encoder_activation(name: str | None, num_labels: int | None) -> str | None:
    if name is None:
        return None
    short = _activation_name(name).lower()
    return {"sigmoid": "sigmoid", "softmax": "softmax", "identity": "none"}.get(short)


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read what the files in ``path`` say; raise CheckpointError where they contradict
    themselves or use a module Heron cannot compute exactly."""
    root = Path(path)
    hf = _json(root / "config.json") or {}
    values: dict[str, Any] = {
        "path": root, "model_type": hf.get("model_type"),
        "architectures": tuple(hf.get("architectures") or ()),
        "remote_code": bool(hf.get("auto_map")),
        "num_labels": len(hf["id2label"]) if isinstance(hf.get("id2label"), dict) else None,
    }
    st_config = _json(root / "config_sentence_transformers.json") or {}
    modules = _json(root / "modules.json") or []
    if (root / "colbert_linear.pt").exists() and (root / "sparse_linear.pt").exists():
        values["bge_m3"] = True
    values["gliner"] = (root / "gliner_config.json").is_file()
    if values["gliner"] and not hf:  # the backbone's config is inside gliner's
        encoder = (_json(root / "gliner_config.json") or {}).get("encoder_config")
        if isinstance(encoder, dict):
            values["model_type"] = encoder.get("model_type")
    values["st_kind"] = st_config.get("model_type") or (
        "SentenceTransformer" if modules else None)
    if isinstance(st_config.get("prompts"), dict):
        values["prompts"] = {str(k): str(v) for k, v in st_config["prompts"].items()}
    values["default_prompt_name"] = st_config.get("default_prompt_name")
    values["similarity"] = st_config.get("similarity_fn_name")
    # CrossEncoder: ST 6 keeps activation_fn in its own config, ST 4-5 in config.json.
    ce_block = hf.get("sentence_transformers") if isinstance(hf.get("sentence_transformers"),
                                                             dict) else {}
    if values["st_kind"] == "CrossEncoder" or ce_block:
        values["st_kind"] = "CrossEncoder"
        values["activation"] = _cross_encoder_activation(
            st_config.get("activation_fn") or ce_block.get("activation_fn"),
            values["num_labels"])
    if "query_prefix" in st_config or "query_length" in st_config:
        values["st_kind"] = "ColBERT"
        values["colbert"] = {k: st_config[k] for k in (
            "query_prefix", "document_prefix", "query_length", "document_length",
            "attend_to_expansion_tokens", "skiplist_words", "do_query_expansion")
            if k in st_config}
    names: list[str] = []
    dense: list[DenseLayer] = []
    for entry in modules:
        module_type = str(entry.get("type", ""))
        name = _class_name(module_type)
        if not module_type.startswith(SERVED_MODULE_PACKAGES) or name not in SERVED_MODULES:
            # Custom code (jina-embeddings-v3's custom_st.Transformer picks a task LoRA) or a
            # module Heron does not compute: serving the rest would give other vectors.
            raise CheckpointError(f"modules.json: module {module_type!r} is not one Heron "
                                  f"computes ({', '.join(sorted(SERVED_MODULES))})")
        names.append(name)
        sub = root / str(entry.get("path", ""))
        if name == "Pooling":
            pooling = _json(sub / "config.json") or {}
            values["pooling"] = _pooling_mode(pooling)
            values["pooling_include_prompt"] = bool(pooling.get("include_prompt", True))
        elif name == "Dense":
            dense.append(_dense_layer(sub))
        elif name == "SpladePooling":
            splade = _json(sub / "config.json") or {}
            values["splade_pooling"] = str(splade.get("pooling_strategy", "max"))
            if splade.get("activation_function", "relu") != "relu":
                raise CheckpointError("SpladePooling: only the relu activation is served")
        elif name == "Router":
            values["inference_free_query"] = _router_query_side(sub)
            values.update(_router_document_side(sub))
        elif name in ("Transformer", "MLMTransformer") and entry.get("path"):
            values["backbone"] = sub
    backbone = values.get("backbone")
    if backbone is not None and not hf:
        inner = _json(backbone / "config.json") or {}
        values.update(model_type=inner.get("model_type"),
                      architectures=tuple(inner.get("architectures") or ()))
    values["st_modules"] = tuple(names)
    values["dense_layers"] = tuple(dense)
    if modules:
        values["normalize"] = "Normalize" in names
    if values["architectures"][:1] == ("HF_ColBERT",) and not dense:
        values["st_kind"] = "ColBERT"
        values["colbert"] = {**_stanford_colbert(root), **(values.get("colbert") or {})}
    sbert = _json(root / "sentence_bert_config.json") or {}
    values["do_lower_case"] = bool(sbert.get("do_lower_case", False))
    if isinstance(sbert.get("max_seq_length"), int):
        values["max_seq_length"] = sbert["max_seq_length"]
    elif isinstance(st_config.get("max_seq_length"), int):
        values["max_seq_length"] = st_config["max_seq_length"]
    elif values["st_kind"] == "CrossEncoder" and isinstance(ce_block.get("max_length"), int):
        values["max_seq_length"] = ce_block["max_length"]
    return Checkpoint(**values)


# Stanford ColBERT's defaults (colbert-ai's ColBERTConfig) where artifact.metadata is absent.
STANFORD_QUERY_TOKEN = "[unused0]"
STANFORD_DOC_TOKEN = "[unused1]"
STANFORD_PROJECTION = "linear.weight"


def _stanford_colbert(root: Path) -> dict[str, Any]:
    """A Stanford ColBERT checkpoint (``HF_ColBERT``), as PyLate's ColBERT loads it: the
    projection is the ``linear.weight`` (no bias) stored with the backbone's weights, and
    ``artifact.metadata`` (colbert-ai's training config) gives the marker tokens, lengths and
    whether [MASK] expansion is attended to, in PyLate's names. PyLate then uses its own
    defaults for what the metadata leaves out."""
    meta = _json(root / "artifact.metadata") or {}
    if not isinstance(meta, dict):
        raise CheckpointError("artifact.metadata: not a JSON object")
    # colbert-ai scores by MaxSim over cosine only with these; l2 similarity or another
    # interaction would rank by something MaxSim of normalized vectors does not compute.
    if meta.get("similarity", "cosine") != "cosine":
        raise CheckpointError(f"artifact.metadata: similarity {meta['similarity']!r} is not "
                              f"served (only cosine MaxSim)")
    if meta.get("interaction", "colbert") != "colbert":
        raise CheckpointError(f"artifact.metadata: interaction {meta['interaction']!r} is not "
                              f"served (only colbert)")
    settings: dict[str, Any] = {
        "query_prefix": str(meta.get("query_token_id") or STANFORD_QUERY_TOKEN),
        "document_prefix": str(meta.get("doc_token_id") or STANFORD_DOC_TOKEN),
        "projection": STANFORD_PROJECTION}
    for key, name in (("query_maxlen", "query_length"), ("doc_maxlen", "document_length"),
                      ("dim", "dim")):
        if meta.get(key) is None:
            continue
        try:
            settings[name] = int(meta[key])
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"artifact.metadata: {key} is not a number: {meta[key]!r}"
                                  ) from exc
    if meta.get("attend_to_mask_tokens") is not None:
        settings["attend_to_expansion_tokens"] = bool(meta["attend_to_mask_tokens"])
    if meta.get("mask_punctuation") is False:
        # colbert-ai keeps punctuation's vectors then; PyLate ignores the flag and drops them
        # (its default skiplist). The checkpoint was trained and indexed keeping them.
        settings["skiplist_words"] = []
    return settings


def _router_query_side(router_dir: Path) -> Path | None:
    """A SparseEncoder Router (inference-free SPLADE): the query route's static weights."""
    config = _json(router_dir / "router_config.json") or _json(router_dir / "config.json") or {}
    structure = config.get("structure") or {}
    query = structure.get("query") or []
    types = config.get("types") or {}
    for key in query:
        if _class_name(str(types.get(key, ""))) == "SparseStaticEmbedding":
            return router_dir / key
    return None


def _router_document_side(router_dir: Path) -> dict[str, Any]:
    """A Router's document route: where its transformer lives and how it pools."""
    config = _json(router_dir / "router_config.json") or {}
    types = config.get("types") or {}
    found: dict[str, Any] = {}
    for key in (config.get("structure") or {}).get("document") or []:
        name = _class_name(str(types.get(key, "")))
        if name in ("Transformer", "MLMTransformer"):
            found["backbone"] = router_dir / key
            sbert = _json(router_dir / key / "sentence_bert_config.json") or {}
            if isinstance(sbert.get("max_seq_length"), int):
                found["max_seq_length"] = sbert["max_seq_length"]
        elif name == "SpladePooling":
            splade = _json(router_dir / key / "config.json") or {}
            found["splade_pooling"] = str(splade.get("pooling_strategy", "max"))
        else:
            raise CheckpointError(f"router_config.json: document module {name} is not served")
    return found


def detect_family(ckpt: Checkpoint) -> str:
    """The adapter that serves this checkpoint, as its files describe it."""
    if ckpt.bge_m3:
        return "bge_m3"
    if ckpt.gliner:
        return "gliner"
    if ckpt.st_kind == "ColBERT":
        return "multi_vector"
    if ckpt.st_kind == "SparseEncoder" or ckpt.splade_pooling is not None:
        return "sparse"
    if ckpt.st_kind == "CrossEncoder":
        return "cross_encoder"
    if ckpt.st_kind == "SentenceTransformer":
        return "dense"
    if ckpt.model_type in ("clip", "siglip"):  # text and vision towers: texts and images
        return "clip"
    arch = " ".join(ckpt.architectures)
    if "ForSequenceClassification" in arch:
        return "cross_encoder"
    if "ForTokenClassification" in arch:
        return "token_classifier"
    if "ForMaskedLM" in arch and not ckpt.is_decoder:
        return "sparse"  # a bare masked LM is served as SPLADE (naver's checkpoints are)
    return "dense"


__all__ = ["DECODER_MODEL_TYPES", "ST_POOLINGS", "Checkpoint", "CheckpointError",
           "DenseLayer", "detect_family", "read_checkpoint"]
