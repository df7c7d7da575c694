"""The model families Heron serves: one table, read by the worker and by the torch-free gateway.

A family's name is the ``adapter:`` value of a model config. Its entry says which calls its
models answer, what ``encode`` produces, and where the worker's implementation lives. The
implementation is a ``"module:Class"`` string, imported only by the worker
(``heron.worker.adapters.adapter_class``): the gateway and the config service route and
validate from this table without importing torch. Adding a family is its adapter file plus
one entry here (docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdapterFamily:
    """What one adapter can do, and the worker class that does it."""

    # The calls its models answer; the first is the one its forward pass computes (a dense
    # encoder also answers score, by the cosine of its embeddings).
    tasks: tuple[str, ...]
    # What its encode produces (empty: it does not encode).
    output_types: frozenset[str]
    # "module:Class" of the worker's Adapter subclass ("" for AUTO, which is resolved to a
    # family when the worker reads the checkpoint).
    implementation: str

    @property
    def task(self) -> str:
        return self.tasks[0]


_WORKER = "heron.worker.adapters"
# A config that names no adapter: the worker reads the checkpoint's files and picks the
# family (heron/runtime/checkpoint.py, detect_family). Until then the gateway routes every
# call to it, and the worker refuses the ones the detected family does not answer.
AUTO = "auto"

ADAPTER_FAMILIES: dict[str, AdapterFamily] = {
    "dense": AdapterFamily(("encode", "score"), frozenset({"dense"}),
                           f"{_WORKER}.dense:DenseAdapter"),
    "sparse": AdapterFamily(("encode",), frozenset({"sparse"}),
                            f"{_WORKER}.sparse:SparseAdapter"),
    # ColBERT-style late interaction: score ranks by MaxSim.
    "multi_vector": AdapterFamily(("encode", "score"),
                                  frozenset({"multi_vector", "dense", "muvera"}),
                                  f"{_WORKER}.multi_vector:MultiVectorAdapter"),
    # BGE-M3: dense, sparse and ColBERT vectors from one forward pass; score by dense cosine.
    "bge_m3": AdapterFamily(("encode", "score"), frozenset({"dense", "sparse", "multi_vector"}),
                            f"{_WORKER}.bge_m3:BgeM3Adapter"),
    # CLIP and SigLIP: texts and images in one space; score ranks by cosine.
    "clip": AdapterFamily(("encode", "score"), frozenset({"dense"}),
                          f"{_WORKER}.clip:ClipAdapter"),
    "cross_encoder": AdapterFamily(("score",), frozenset(),
                                   f"{_WORKER}.cross_encoder:CrossEncoderAdapter"),
    "token_classifier": AdapterFamily(("extract",), frozenset(),
                                      f"{_WORKER}.token_classifier:TokenClassifierAdapter"),
    # GLiNER span models: zero-shot extraction of the entity types a request names.
    "gliner": AdapterFamily(("extract",), frozenset(), f"{_WORKER}.gliner:GlinerAdapter"),
    # No compute, fixed vectors: Heron's own overhead, measured by bench/ (bundles/null.yaml).
    "null": AdapterFamily(("encode",), frozenset({"dense"}), f"{_WORKER}.null:NullAdapter"),
    AUTO: AdapterFamily(("encode", "score", "extract"),
                        frozenset({"dense", "sparse", "multi_vector", "muvera"}), ""),
}
ADAPTERS: tuple[str, ...] = tuple(ADAPTER_FAMILIES)


def adapter_family(name: str) -> AdapterFamily:
    """The table's entry for ``name``; KeyError names the known adapters."""
    try:
        return ADAPTER_FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown adapter {name!r}; known: {', '.join(ADAPTERS)}") from None


__all__ = ["ADAPTERS", "ADAPTER_FAMILIES", "AUTO", "AdapterFamily", "adapter_family"]
