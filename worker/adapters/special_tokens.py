"""The special tokens a tokenizer puts around a single text, for texts given as token ids.

transformers 5's fast tokenizers have no ``build_inputs_with_special_tokens`` or
``prepare_for_model``; the template is found by tokenizing a probe with and without special
tokens: ``[CLS] ... [SEP]`` (BERT), ``<s> ... </s>`` (RoBERTa), ``... </s>`` (T5), none."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

PROBE = "hello"


def special_tokens_around(tokenizer: PreTrainedTokenizerBase
                          ) -> tuple[list[int], list[int], bool]:
    """(ids before the text, ids after it, whether the tokenizer gives token_type_ids)."""
    bare = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    enc = tokenizer(PROBE)
    full = enc["input_ids"]
    at = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare),
              None)
    if at is None:  # a post-processor that rewrites the text's own tokens: none known
        raise ValueError("the tokenizer changes a text's tokens when it adds special tokens")
    return full[:at], full[at + len(bare):], "token_type_ids" in enc
