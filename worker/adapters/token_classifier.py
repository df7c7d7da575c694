"""Token classification ``extract``: per-token labels merged into entity spans.

BIO/IOB2 tags (``B-PER``, ``I-PER``) and plain tags (``PER``) are both understood; ``O``
and special tokens are skipped. An entity's score is the mean of its tokens' probabilities.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForTokenClassification

from heron.worker.adapters.base import Adapter, Batch, Tokenized
from heron_sdk.types import Entity


class TokenClassifierAdapter(Adapter):
    name = "token_classifier"
    needs_offsets = True

    def load_model(self, path: Path) -> torch.nn.Module:
        model = self.load_with_head(AutoModelForTokenClassification, path)
        self.id2label = {int(k): str(v) for k, v in model.config.id2label.items()}
        return model

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.model(**batch.model_inputs()).logits.float(), dim=-1)
        best, label_ids = probs.max(dim=-1)
        return best.cpu(), label_ids.cpu()

    def postprocess(self, batch: Batch, output: tuple) -> list[list[Entity]]:
        best, label_ids = output
        return [self._spans(item, best[row].tolist(), label_ids[row].tolist())
                for row, item in enumerate(batch.items)]

    def _spans(self, item: Tokenized, probs: list[float], labels: list[int]) -> list[Entity]:
        entities: list[Entity] = []
        current: tuple[str, int, int, list[float]] | None = None

        def close() -> None:
            if current is not None:
                kind, start, end, scores = current
                entities.append(Entity(label=kind, text=item.text[start:end], start=start,
                                       end=end, score=sum(scores) / len(scores)))

        assert item.offsets is not None
        for pos in range(item.length):
            start, end = item.offsets[pos]
            if start == end:  # special token
                continue
            tag = self.id2label.get(labels[pos], "O")
            prefix, _, kind = tag.partition("-") if "-" in tag else ("", "", tag)
            if tag == "O" or kind == "O":
                close()
                current = None
                continue
            continues = (current is not None and current[0] == kind and
                         (prefix == "I" or (prefix == "" or start == current[2])))
            if continues and current is not None:
                current = (kind, current[1], end, [*current[3], probs[pos]])
            else:
                close()
                current = (kind, start, end, [probs[pos]])
        close()
        return entities
