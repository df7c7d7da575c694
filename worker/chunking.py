"""Where a long text is cut into chunks (sans-IO): from its tokens' character offsets.

encode's ``chunking`` option (heron_sdk.chunking) asks for each text to be split into
chunks of at most ``max_tokens`` of the model's tokens; heron.worker.chunked_encode
tokenizes the text once (no special tokens, no truncation) and hands the offsets here. A
chunk is a character span ``text[start:end]`` from its first token's start to its last
token's end, which the worker then encodes as an item of its own: its vector is exactly
that of the chunk's text sent alone. Characters between chunks are only ones no token
covers (whitespace, characters the tokenizer drops).

Strategies:
- ``tokens``: windows of ``max_tokens`` tokens, each starting ``overlap`` tokens before the
  previous one ended. A window is cut back to the last word boundary (a gap between two
  tokens) in its second half, so that a word is not split between chunks: its re-tokenized
  text then has the same tokens. A window without one (a long URL, text without spaces) is
  cut where it is full.
- ``sentences``: whole sentences packed up to ``max_tokens`` tokens; a chunk starts with as
  many of the previous chunk's last sentences as fit in ``overlap`` tokens. A sentence
  longer than ``max_tokens`` is split by tokens, on its own.

A sentence ends at ``.``, ``!``, ``?`` or ``…`` (closing quotes and brackets after them
included) followed by whitespace, at the CJK full stop, exclamation and question marks, and
at a blank line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

Offsets = Sequence[tuple[int, int]]  # each token's (start, end) characters, end exclusive

# Sentence ends. Escaped: the ellipsis; closing quotes and brackets (also CJK ones); the CJK
# full stop, exclamation and question marks.
_CLOSERS = "\"'\u201d\u2019\u00bb\u300d\u300f)\\]"
_SENTENCE_END = re.compile(f"[.!?\u2026]+[{_CLOSERS}]*(?=\\s|$)"
                           f"|[\u3002\uff01\uff1f]+[{_CLOSERS}]*|\n[ \t]*\n")


@dataclass(frozen=True, slots=True)
class Chunk:
    """``text[start:end]``, and how many of the text's tokens it holds (no special ones)."""

    start: int
    end: int
    tokens: int


def split_text(text: str, offsets: Offsets, max_tokens: int, overlap: int = 0,
               strategy: str = "tokens") -> list[Chunk]:
    """The chunks of ``text`` whose tokens are at ``offsets``, in order. A text without
    tokens (empty, or only whitespace) is one chunk of all of it, as it would be encoded
    unchunked."""
    if max_tokens < 1 or not 0 <= overlap < max_tokens:
        raise ValueError(f"need 0 <= overlap ({overlap}) < max_tokens ({max_tokens})")
    if not offsets:
        return [Chunk(0, len(text), 0)]
    if strategy == "sentences":
        ranges = sentence_windows(sentence_ranges(text, offsets), offsets, max_tokens, overlap)
    elif strategy == "tokens":
        ranges = token_windows(offsets, 0, len(offsets), max_tokens, overlap)
    else:
        raise ValueError(f"unknown chunking strategy {strategy!r}")
    return [Chunk(*_span(offsets, first, stop), stop - first) for first, stop in ranges]


def _span(offsets: Offsets, first: int, stop: int) -> tuple[int, int]:
    """The characters of tokens ``first .. stop - 1``. Tokens that cover no character (some
    tokenizers give a lone word-start marker ``(0, 0)``) do not place it."""
    spans = [offsets[k] for k in range(first, stop) if offsets[k][1] > offsets[k][0]]
    if not spans:
        return offsets[first][0], offsets[first][0]
    return min(s for s, _ in spans), max(e for _, e in spans)


def min_chunks(tokens: int, max_tokens: int) -> int:
    """The fewest chunks ``tokens`` tokens can make, whatever the overlap (cuts moved to word
    boundaries may overlap less than asked): a bound known before splitting."""
    return max(1, -(-tokens // max_tokens))


def _word_start(offsets: Offsets, j: int) -> bool:
    """A word begins at token ``j``: characters no token covers lie before it."""
    return offsets[j - 1][1] < offsets[j][0]


def token_windows(offsets: Offsets, first: int, stop: int, max_tokens: int,
                  overlap: int) -> list[tuple[int, int]]:
    """Token ranges ``[a, b)`` covering tokens ``first .. stop - 1`` (the tokens strategy)."""
    out: list[tuple[int, int]] = []
    start = first
    while True:
        end = min(start + max_tokens, stop)
        if end < stop:  # back to a word boundary, if one lies in the window's second half
            floor = start + max_tokens // 2
            end = next((j for j in range(end, floor, -1) if _word_start(offsets, j)), end)
        out.append((start, end))
        if end >= stop:
            return out
        following = end
        if overlap:  # the first word start at most ``overlap`` tokens back
            back = max(end - overlap, start + 1)
            following = next((j for j in range(back, end) if _word_start(offsets, j)), back)
        start = max(following, start + 1)  # always forward, however the cuts fell


def sentence_ranges(text: str, offsets: Offsets) -> list[tuple[int, int]]:
    """Each sentence's token range ``[a, b)``, in order; a token belongs to the sentence
    its first character is in. Sentences without tokens are left out."""
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    out: list[tuple[int, int]] = []
    first, boundary = 0, 0
    for k, (start, _) in enumerate(offsets):
        moved = False
        while boundary < len(ends) and start >= ends[boundary]:
            boundary += 1
            moved = True
        if moved and k > first:
            out.append((first, k))
            first = k
    out.append((first, len(offsets)))
    return out


def sentence_windows(sentences: list[tuple[int, int]], offsets: Offsets, max_tokens: int,
                     overlap: int) -> list[tuple[int, int]]:
    """Token ranges of whole sentences packed up to ``max_tokens`` (the sentences
    strategy); a sentence over it is split by tokens."""
    out: list[tuple[int, int]] = []
    current: list[tuple[int, int]] = []  # the sentences of the chunk being filled

    def size(group: list[tuple[int, int]]) -> int:
        return group[-1][1] - group[0][0] if group else 0

    for sentence in sentences:
        length = sentence[1] - sentence[0]
        if length > max_tokens:  # too long for any chunk: cut by tokens, on its own
            if current:
                out.append((current[0][0], current[-1][1]))
            out += token_windows(offsets, sentence[0], sentence[1], max_tokens, overlap)
            current = []
            continue
        if current and size(current) + length > max_tokens:
            out.append((current[0][0], current[-1][1]))
            # The next chunk repeats the last sentences that fit in ``overlap`` tokens,
            # and that leave room for this one.
            carried: list[tuple[int, int]] = []
            for previous in reversed(current):
                grown = [previous, *carried]
                if size(grown) > overlap or size(grown) + length > max_tokens:
                    break
                carried = grown
            current = carried
        current.append(sentence)
    if current:
        out.append((current[0][0], current[-1][1]))
    return out
