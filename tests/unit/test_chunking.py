"""encode's chunking: the option's parsing (heron_sdk.chunking) and where texts are cut
(heron.worker.chunking), with a word-and-punctuation tokenizer standing in for the model's
(tests/integration/test_chunking.py runs MiniLM's own)."""

from __future__ import annotations

import itertools
import re

import pytest

from heron.worker.chunking import Chunk, min_chunks, split_text
from heron_sdk.chunking import ChunkingOptions, check_chunking
from heron_sdk.errors import HeronError
from heron_sdk.types import EncodeRequest

_TOKEN = re.compile(r"\w{1,4}|[^\w\s]")  # words of over 4 letters make several tokens


def offsets(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _TOKEN.finditer(text)]


def sentences(count: int, words: int = 6) -> str:
    return " ".join(f"Sentence {n} " + " ".join(f"w{n}x{k}" for k in range(words)) + "."
                    for n in range(count))


def assert_covers(text: str, chunks: list[Chunk]) -> None:
    """In order, and only characters no token covers lie outside every chunk."""
    covered = [False] * len(text)
    for c in chunks:
        covered[c.start:c.end] = [True] * (c.end - c.start)
    for a, b in itertools.pairwise(chunks):
        assert a.start < b.start and a.end <= b.end, (a, b)
    for start, end in offsets(text):
        assert all(covered[start:end]), text[start:end]


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 16, 50, 1000])
@pytest.mark.parametrize("overlap", [0, 1, 5])
def test_token_windows_cover_the_text_within_the_bound(max_tokens: int, overlap: int) -> None:
    if overlap >= max_tokens:
        return
    text = sentences(20) + " averyveryverylongwordwithoutspaces " + "x" * 90
    chunks = split_text(text, offsets(text), max_tokens, overlap)
    assert_covers(text, chunks)
    for c in chunks:
        assert 1 <= c.tokens <= max_tokens
        assert len(offsets(text[c.start:c.end])) == c.tokens  # re-tokenized, the same
    if overlap == 0:
        assert sum(c.tokens for c in chunks) == len(offsets(text))
    assert len(chunks) >= min_chunks(len(offsets(text)), max_tokens)


def test_windows_end_at_word_boundaries_and_overlap_by_about_overlap() -> None:
    text = sentences(30)
    tokens = offsets(text)
    chunks = split_text(text, tokens, 20, 5)
    starts = {s for s, _ in tokens}
    for a, b in itertools.pairwise(chunks):
        assert text[a.end:a.end + 1] in (" ", "")  # never inside a word
        assert b.start in starts and (b.start == 0 or text[b.start - 1] == " ")
        shared = sum(1 for s, e in tokens if b.start <= s and e <= a.end)
        assert 1 <= shared <= 5


def test_sentences_are_packed_whole() -> None:
    text = sentences(25)  # 14 to 15 tokens a sentence
    chunks = split_text(text, offsets(text), 40, 0, "sentences")
    assert_covers(text, chunks)
    for c in chunks:
        piece = text[c.start:c.end]
        assert piece.startswith("Sentence") and piece.endswith("."), piece
        assert c.tokens <= 40
    for a, b in itertools.pairwise(chunks):  # packed: b's first would not fit
        first = text[b.start:text.index(".", b.start) + 1]
        assert a.tokens + len(offsets(first)) > 40


def test_sentence_overlap_repeats_whole_sentences() -> None:
    text = sentences(10)
    chunks = split_text(text, offsets(text), 45, 16, "sentences")
    for a, b in itertools.pairwise(chunks):
        assert text[b.start:b.end].startswith("Sentence")
        assert a.start < b.start < a.end  # the previous chunk's last sentence, again


def test_a_sentence_over_max_tokens_is_split_by_tokens() -> None:
    long = "Start " + " ".join(f"w{k}" for k in range(100)) + "."
    text = f"Short one. {long} Short two."
    chunks = split_text(text, offsets(text), 30, 0, "sentences")
    assert_covers(text, chunks)
    assert text[chunks[0].start:chunks[0].end] == "Short one."
    assert text[chunks[-1].start:chunks[-1].end] == "Short two."
    assert all(c.tokens <= 30 for c in chunks)


def test_cjk_and_paragraph_breaks_end_sentences() -> None:
    text = "第一句。第二句。\n\nA heading\n\nBody text."
    chunks = split_text(text, offsets(text), 3, 0, "sentences")
    assert [text[c.start:c.end] for c in chunks] == [
        "第一句。", "第二句。", "A heading", "Body text."]


@pytest.mark.parametrize("text", ["", "   \n "])
def test_a_text_without_tokens_is_one_chunk(text: str) -> None:
    assert split_text(text, offsets(text), 8) == [Chunk(0, len(text), 0)]


def test_short_text_is_one_chunk() -> None:
    text = "Just a few words."
    assert split_text(text, offsets(text), 64) == [Chunk(0, len(text), 6)]


# ---- the option ----------------------------------------------------------------------------
def test_parse_and_round_trip() -> None:
    body = {"items": ["a"], "chunking": {"max_tokens": 128.0, "overlap": 16,
                                         "strategy": "sentences", "pool": "mean"}}
    req = EncodeRequest.from_wire(body)
    assert req.chunking == ChunkingOptions(128, 16, "sentences", "mean")
    assert EncodeRequest.from_wire(req.to_wire()).chunking == req.chunking
    assert EncodeRequest.from_wire({"items": ["a"], "chunking": {}}).chunking == \
        ChunkingOptions()
    assert EncodeRequest.from_wire({"items": ["a"], "chunking": None}).chunking is None
    assert "chunking" not in EncodeRequest.from_wire({"items": ["a"]}).to_wire()
    assert ChunkingOptions.of(True) == ChunkingOptions()
    assert ChunkingOptions.of({"max_tokens": 8}) == ChunkingOptions(8)


@pytest.mark.parametrize(("chunking", "extra", "field"), [
    ([], {}, "chunking"),
    ({"size": 3}, {}, "chunking.size"),
    ({"max_tokens": 0}, {}, "chunking.max_tokens"),
    ({"max_tokens": True}, {}, "chunking.max_tokens"),
    ({"max_tokens": 2**31}, {}, "chunking.max_tokens"),
    ({"overlap": -1}, {}, "chunking.overlap"),
    ({"max_tokens": 8, "overlap": 8}, {}, "chunking.overlap"),
    ({"strategy": "words"}, {}, "chunking.strategy"),
    ({"pool": "max"}, {}, "chunking.pool"),
    ({"pool": "mean"}, {"output_types": ["sparse"]}, "chunking.pool"),
    ({}, {"items": ["a", {"tokens": [1, 2]}]}, "items[1].tokens"),
    ({}, {"items": [{"image": "iVBORw0KGgo="}]}, "items[0].image"),
])
def test_bad_options_name_their_field(chunking: object, extra: dict, field: str) -> None:
    """Each field alone is the parser's (as the OpenAPI schema says); what needs the rest of
    the request is check_chunking's (the gateway's and the worker's)."""
    with pytest.raises(HeronError) as caught:
        req = EncodeRequest.from_wire({"items": ["a"], "chunking": chunking, **extra})
        check_chunking(req.chunking, req.items, req.output_types)
    assert caught.value.status == 422
    assert caught.value.field == field, caught.value.message


def test_tokens_that_cover_no_character_do_not_place_a_chunk() -> None:
    text = "alpha beta gamma delta"
    spans = offsets(text)
    marked = [spans[0], spans[1], (0, 0), *spans[2:]]  # a (0, 0) marker inside the text
    chunks = split_text(text, marked, 2)
    assert all(a.start < b.start for a, b in itertools.pairwise(chunks))  # none back at 0
    assert chunks[-1].end == len(text)
