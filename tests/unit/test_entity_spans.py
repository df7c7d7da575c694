"""BIO merging of token labels into entity spans (token_classifier adapter)."""

from __future__ import annotations

from heron.worker.adapters.base import Tokenized
from heron.worker.adapters.token_classifier import TokenClassifierAdapter

LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC", 5: "ORG"}


def spans(text: str, offsets: list[tuple[int, int]], labels: list[int],
          probs: list[float] | None = None) -> list[tuple[str, str, int, int]]:
    adapter = TokenClassifierAdapter.__new__(TokenClassifierAdapter)
    adapter.id2label = LABELS
    item = Tokenized(input_ids=list(range(len(offsets))), token_type_ids=None,
                     truncated=False, text=text, offsets=offsets)
    found = adapter._spans(item, probs or [0.9] * len(offsets), labels)
    for e in found:
        assert e.text == text[e.start:e.end]
    return [(e.label, e.text, e.start, e.end) for e in found]


def test_bio_tags_merge_into_spans_and_specials_are_skipped() -> None:
    text = "John Smith lives in New York"
    offsets = [(0, 0), (0, 4), (5, 10), (11, 16), (17, 19), (20, 23), (24, 28), (0, 0)]
    labels = [1, 1, 2, 0, 0, 3, 4, 3]  # specials carry junk labels: ignored
    assert spans(text, offsets, labels) == [("PER", "John Smith", 0, 10),
                                            ("LOC", "New York", 20, 28)]


def test_a_new_b_tag_starts_a_new_entity() -> None:
    text = "Ann Bob"
    assert spans(text, [(0, 3), (4, 7)], [1, 1]) == [("PER", "Ann", 0, 3), ("PER", "Bob", 4, 7)]


def test_subword_pieces_join_their_word() -> None:
    text = "Washington"
    # "Wash" "##ington": the piece got a B- tag but touches the previous piece.
    assert spans(text, [(0, 4), (4, 10)], [3, 3]) == [("LOC", "Washington", 0, 10)]


def test_plain_tags_and_type_changes() -> None:
    text = "Acme Corp Paris"
    got = spans(text, [(0, 4), (5, 9), (10, 15)], [5, 5, 3])
    assert got == [("ORG", "Acme Corp", 0, 9), ("LOC", "Paris", 10, 15)]


def test_entity_score_is_mean_of_token_probabilities() -> None:
    adapter = TokenClassifierAdapter.__new__(TokenClassifierAdapter)
    adapter.id2label = LABELS
    item = Tokenized(input_ids=[1, 2], token_type_ids=None, truncated=False, text="Jo Ann",
                     offsets=[(0, 2), (3, 6)])
    (entity,) = adapter._spans(item, [0.5, 0.7], [1, 2])
    assert abs(entity.score - 0.6) < 1e-9
