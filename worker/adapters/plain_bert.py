"""BERT's encoder run as a plain sequence of torch calls: on packed batches (CPU, BERT) and
on padded ones (CUDA graphs, worker/adapters/cuda_graphs.py; BERT, RoBERTa and XLM-R,
whose layers are BERT's and whose positions start after the padding index).

transformers' ``BertModel.forward`` reaches each layer through several Python wrappers
(keyword-argument decorators, output capture, config lookups, signature inspection) and a
module call per projection and norm. The arithmetic is the same here, on the same weights, in
the same order, with the query, key and value projections in one matmul. The answers are
bit-identical to the model's own forward under bf16 autocast and within 1e-5 in fp32
(tests/unit/test_plain_bert.py, test_cuda_graphs.py); the parity suite compares both with
sentence-transformers.

Why, on packed batches: with ``--inference-threads`` the passes share one GIL, and a
thread that holds it for Python keeps the others' finished matmuls waiting. On MiniLM (bf16
autocast, one torch thread a pass, batches of 8 mixed 8-128-token texts) two threads ran
83-87 passes/s through the model's forward and 94-96 through this path; one thread ran 4-10%
faster. Where the activation is exact GELU, the packed layers go one step further: one
TorchScript call that does not hold the GIL at all (adapters/scripted_bert.py; the eager
loop below stays for other activations and for padded batches). On padded batches it is
what a CUDA graph captures: no host synchronisation, and every weight read from the same
tensor each pass.

Used only while the model is exactly what transformers loaded: its family's classes, in
eval mode, no module replaced (a LoRA adapter wraps its layers; checked by identity each pass,
about 80 attribute reads). Otherwise the adapter calls the model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from heron.worker.adapters.packing import Packing, attend
from heron.worker.adapters.scripted_bert import run_without_gil, scripted_packed_layers

Tensor = torch.Tensor
# (parent, attribute, the module it held when the path was built)
Binding = tuple[torch.nn.Module, str, torch.nn.Module]


@dataclass(slots=True)
class FusedProjection:
    """One layer's query, key and value projections as one [3H, H] matmul. The layers'
    weights are slices of it, so a change in place reaches it; its ``source`` (data pointers
    and version counters of the tensors it was made from) tells when one was replaced."""

    source: tuple[tuple[int, int], ...]
    weight: Tensor
    bias: Tensor | None


def projection_source(attention: torch.nn.Module) -> tuple[tuple[int, int], ...]:
    tensors = [t for m in (attention.query, attention.key, attention.value)
               for t in (m.weight, m.bias) if t is not None]
    return tuple((t.data_ptr(), t._version) for t in tensors)


def family(model: torch.nn.Module) -> tuple[Any, str, int] | None:
    """(transformers' modelling module, its class prefix, the first real position) when
    ``model`` is exactly one of the BERT-shaped encoders: BERT, or RoBERTa and XLM-R, whose
    positions start after the padding index."""
    from transformers.models.bert import modeling_bert
    kind = type(model)
    if kind is modeling_bert.BertModel:
        return modeling_bert, "Bert", 0
    from transformers.models.roberta import modeling_roberta
    from transformers.models.xlm_roberta import modeling_xlm_roberta
    if kind not in (modeling_roberta.RobertaModel, modeling_xlm_roberta.XLMRobertaModel):
        return None
    offset = int(model.embeddings.padding_idx) + 1
    if kind is modeling_roberta.RobertaModel:
        return modeling_roberta, "Roberta", offset
    return modeling_xlm_roberta, "XLMRoberta", offset


class PlainBert:
    """The plain path for one loaded BERT-shaped model; ``build`` says whether it has one."""

    def __init__(self, model: torch.nn.Module, bindings: list[Binding],
                 position_offset: int = 0) -> None:
        self.model = model
        self.bindings = bindings
        # Right-padded items' real tokens sit at these positions (RoBERTa's start after its
        # padding index); only BERT's batches are packed (adapters/packing.py).
        self.position_offset = position_offset
        self.layers = list(model.encoder.layer)
        self.fused: list[FusedProjection | None] = [None] * len(self.layers)
        self._fusing = threading.Lock()
        # Packed batches' layers in TorchScript, without the GIL (adapters/scripted_bert.py)
        # where every layer's activation is exact GELU, as the scripted function's is, and
        # while each is still the one seen here (checked by identity each pass).
        self.activations = [layer.intermediate.intermediate_act_fn for layer in self.layers]
        self.scripted = scripted_packed_layers() if all(
            exact_gelu(act) for act in self.activations) else None

    @classmethod
    def build(cls, model: torch.nn.Module) -> PlainBert | None:
        """The path for ``model``, or None where it is not transformers' plain BertModel,
        RobertaModel or XLMRobertaModel (a decoder, relative positions, cross-attention, a
        replaced module)."""
        found = family(model)
        if found is None:
            return None
        hf, prefix, offset = found

        def cls_(name: str) -> type:
            return getattr(hf, prefix + name)
        config = model.config
        if (config.is_decoder
                or getattr(config, "add_cross_attention", False)
                or getattr(config, "position_embedding_type", "absolute") != "absolute"):
            return None
        kinds = {"word_embeddings": torch.nn.Embedding,
                 "position_embeddings": torch.nn.Embedding,
                 "token_type_embeddings": torch.nn.Embedding, "LayerNorm": torch.nn.LayerNorm,
                 "attention": cls_("Attention"), "self": cls_("SelfAttention"),
                 "query": torch.nn.Linear, "key": torch.nn.Linear, "value": torch.nn.Linear,
                 "intermediate": cls_("Intermediate"), "dense": torch.nn.Linear}
        bindings: list[Binding] = []

        def bind(parent: torch.nn.Module, name: str, kind: type | None = None) -> bool:
            child = getattr(parent, name, None)
            if type(child) is not (kind or kinds[name]):
                return False
            bindings.append((parent, name, child))
            return True

        emb = model.embeddings
        if not (bind(model, "embeddings", cls_("Embeddings")) and all(
                bind(emb, n) for n in ("word_embeddings", "position_embeddings",
                                       "token_type_embeddings", "LayerNorm"))):
            return None
        if not bind(model, "encoder", cls_("Encoder")):
            return None
        for index, layer in enumerate(model.encoder.layer):
            if not (bind(model.encoder.layer, str(index), cls_("Layer"))
                    and bind(layer, "attention")
                    and bind(layer.attention, "self")
                    and all(bind(layer.attention.self, n) for n in ("query", "key", "value"))
                    and bind(layer.attention, "output", cls_("SelfOutput"))
                    and bind(layer, "intermediate") and bind(layer.intermediate, "dense")
                    and bind(layer, "output", cls_("Output"))
                    and all(bind(m, "dense") and bind(m, "LayerNorm")
                            for m in (layer.attention.output, layer.output))):
                return None
            projections = [layer.attention.self.query, layer.attention.self.key,
                           layer.attention.self.value]
            if layer.attention.self.is_causal or len({m.bias is None for m in projections}) > 1:
                return None
        return cls(model, bindings, offset)

    def usable(self) -> bool:
        """The model is still as built: eval mode, every module the one bound."""
        return not self.model.training and all(
            getattr(parent, name) is child for parent, name, child in self.bindings)

    def states(self, input_ids: Tensor, token_type_ids: Tensor | None,
               position_ids: Tensor, packing: Packing) -> Tensor:
        """Last hidden states [1, T, H] of a packed [1, T] batch, as ``BertModel`` gives."""
        x = self._embed(input_ids[0], None if token_type_ids is None else token_type_ids[0],
                        F.embedding(position_ids[0], self.model.embeddings.position_embeddings
                                    .weight))
        if self.scripted is not None and all(
                layer.intermediate.intermediate_act_fn is act
                for layer, act in zip(self.layers, self.activations, strict=True)):
            return self._scripted_layers(x, packing).unsqueeze(0)
        total = x.shape[0]

        def packed(qkv: Tensor, attention: torch.nn.Module) -> Tensor:
            heads, dim = attention.num_attention_heads, attention.attention_head_size
            q, k, v = qkv.view(total, 3, heads, dim).unbind(1)
            return attend(q, k, v, packing.attention, attention.scaling)
        return self._encode(x, packed).unsqueeze(0)

    def padded_states(self, input_ids: Tensor, token_type_ids: Tensor | None,
                      attention_mask: Tensor) -> Tensor:
        """Last hidden states [B, L, H] of a right-padded [B, L] batch, as ``BertModel``
        gives at its real tokens (torch's attention, masked keys at the dtype's lowest
        value)."""
        rows, width = input_ids.shape
        first = self.position_offset
        x = self._embed(input_ids, token_type_ids,
                        self.model.embeddings.position_embeddings.weight[first:first + width])
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min

        def padded(qkv: Tensor, attention: torch.nn.Module) -> Tensor:
            heads, dim = attention.num_attention_heads, attention.attention_head_size
            q, k, v = qkv.view(rows, width, 3, heads, dim).permute(2, 0, 3, 1, 4).unbind(0)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                                 scale=attention.scaling)
            return out.transpose(1, 2).reshape(rows, width, heads * dim)
        return self._encode(x, padded)

    def _embed(self, input_ids: Tensor, token_type_ids: Tensor | None,
               positions: Tensor) -> Tensor:
        emb = self.model.embeddings
        x = F.embedding(input_ids, emb.word_embeddings.weight)
        if token_type_ids is not None:
            x = x + F.embedding(token_type_ids, emb.token_type_embeddings.weight)
        else:
            x = x + emb.token_type_embeddings.weight[0]
        return layer_norm(x + positions, emb.LayerNorm)

    def _scripted_layers(self, x: Tensor, packing: Packing) -> Tensor:
        """``_encode`` with ``attend`` over ``packing``, as one TorchScript call. The weights
        are read from the modules each pass, as the eager loop reads them."""
        weights: list[Tensor] = []
        biases: list[Tensor | None] = []
        eps: list[float] = []
        for i, layer in enumerate(self.layers):
            fused = self._projection(i)
            attn_out, inner, out = layer.attention.output, layer.intermediate, layer.output
            weights += (fused.weight, attn_out.dense.weight, attn_out.LayerNorm.weight,
                        inner.dense.weight, out.dense.weight, out.LayerNorm.weight)
            biases += (fused.bias, attn_out.dense.bias, attn_out.LayerNorm.bias,
                       inner.dense.bias, out.dense.bias, out.LayerNorm.bias)
            eps += (attn_out.LayerNorm.eps, out.LayerNorm.eps)
        attention = self.layers[0].attention.self
        groups = packing.attention
        return run_without_gil(
            self.scripted, x, weights, biases, eps, attention.num_attention_heads,
            attention.attention_head_size, attention.scaling, [g.gather for g in groups],
            [g.mask for g in groups], [g.valid for g in groups], [g.rows for g in groups],
            [g.items for g in groups], [g.length for g in groups])

    def _encode(self, x: Tensor, attend_fn: Callable[[Tensor, torch.nn.Module], Tensor]
                ) -> Tensor:
        """The layers, each attending through ``attend_fn(fused q/k/v, its attention)``."""
        for i, layer in enumerate(self.layers):
            fused = self._projection(i)
            attended = attend_fn(F.linear(x, fused.weight, fused.bias), layer.attention.self)
            out = layer.attention.output
            x = layer_norm(F.linear(attended, out.dense.weight, out.dense.bias) + x,
                           out.LayerNorm)
            inner = layer.intermediate
            h = inner.intermediate_act_fn(F.linear(x, inner.dense.weight, inner.dense.bias))
            out = layer.output
            x = layer_norm(F.linear(h, out.dense.weight, out.dense.bias) + x, out.LayerNorm)
        return x

    def fuse_all(self) -> tuple[int, ...]:
        """Fuse every layer's projections now (not inside a graph capture); the fused
        tensors' identities, which change when a weight was replaced."""
        return tuple(id(self._projection(i)) for i in range(len(self.layers)))

    def _projection(self, index: int) -> FusedProjection:
        attention = self.layers[index].attention.self
        fused = self.fused[index]
        if fused is not None and fused.source == projection_source(attention):
            return fused
        with self._fusing:
            fused = self.fused[index]
            if fused is None or fused.source != projection_source(attention):
                fused = self.fused[index] = fuse(attention)
            return fused


def fuse(attention: torch.nn.Module) -> FusedProjection:
    """Concatenate the three projections and point the layers' weights at slices of the
    result, so the model holds them once (the memory accounting counts them as before)."""
    linears = (attention.query, attention.key, attention.value)
    with torch.inference_mode(False), torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
        rows = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight = torch.nn.Parameter(weight[rows: rows + n], requires_grad=False)
            if bias is not None:
                m.bias = torch.nn.Parameter(bias[rows: rows + n], requires_grad=False)
            rows += n
    return FusedProjection(source=projection_source(attention), weight=weight, bias=bias)


def exact_gelu(act: Any) -> bool:
    """Whether ``act`` is transformers' GELU on torch's exact (erf) kernel."""
    from transformers.activations import GELUActivation
    return type(act) is GELUActivation and act.act is F.gelu


def layer_norm(x: Tensor, norm: torch.nn.Module) -> Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
