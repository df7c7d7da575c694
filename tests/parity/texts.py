"""The parity suite's 50 texts: mixed lengths from a few words to past every tiny model's
limit (8 to about 300 tokens), so truncation is exercised. Plain Python, no imports of
Heron: the reference scripts run it in their own venvs."""

from __future__ import annotations

import random

_WORDS = ("the heron stood in the shallow water of the river while small fish moved "
          "around its legs and the morning light came over the hills paris is the capital "
          "of france embeddings rerankers extraction models serve queries documents about "
          "science history music sport cooking travel weather markets law medicine, "
          "Zürich naïve café 東京 2024 42.5% don't re-rank!").split()


def parity_texts(count: int = 50, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for i in range(count):
        # Lengths spread over 2..240 words (about 3..300 tokens), a few very short.
        words = 2 + (i * 37) % 239 if i % 5 else rng.randint(2, 12)
        texts.append(" ".join(rng.choice(_WORDS) for _ in range(words)))
    return texts


QUERY = "where does the heron fish in the morning?"
