"""The fixed vocabulary of the synthetic arithmetic word problems.

Everything the generator writes (questions, worked solutions, the prompt frame) is built from these
words, single digits and a few symbols, so a word-level tokenizer with a few dozen entries covers it.
Both the generator (synthetic_math.py) and the tokenizer (math_tokenizer.py) read these lists; changing
one of them changes the tokenizer's vocabulary.
"""
from __future__ import annotations

NAMES: tuple[str, ...] = ("Tom", "Ann", "Sam", "Mia")
OBJECTS: tuple[str, ...] = ("apples", "coins", "books", "cards")
# Phrases that raise the count: "{name} buys 5 more."
ADD_VERBS: tuple[str, ...] = ("buys", "finds", "gets")
# Phrases that lower the count: "{name} gives away 6."
SUB_VERBS: tuple[str, ...] = ("gives away", "loses", "sells")
# Words of the sentence frame: "{name} has 57 apples. ... Then ... How many apples does {name} have now?"
FRAME_WORDS: tuple[str, ...] = ("has", "more", "Then", "How", "many", "does", "have", "now")
# Words of the prompt frame ("Question: ...\nAnswer:"), which start a line and so never follow a space.
PROMPT_WORDS: tuple[str, ...] = ("Question", "Answer")
# Symbols that follow a word or digit directly (never a space).
SYMBOLS: tuple[str, ...] = (".", "?", ":", "+", "-", "=", "\n")
ANSWER_MARK = "####"
DIGITS: tuple[str, ...] = tuple("0123456789")

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)


def _words(phrases: tuple[str, ...]) -> list[str]:
    return [word for phrase in phrases for word in phrase.split()]


def vocabulary() -> list[str]:
    """All tokens in id order: special tokens first, then the pieces the pre-tokenizer can emit.

    A word inside a sentence carries its leading space (" buys"); a word or digit that can start a text
    or follow a symbol also appears bare ("Tom", "5"). Returns a list of unique strings.
    """
    spaced = _words(NAMES + OBJECTS + ADD_VERBS + SUB_VERBS + FRAME_WORDS)
    bare = list(NAMES) + list(PROMPT_WORDS)
    pieces = (list(SPECIAL_TOKENS) + [" " + w for w in spaced] + bare + list(DIGITS)
              + [" " + d for d in DIGITS] + list(SYMBOLS) + [ANSWER_MARK, " " + ANSWER_MARK])
    return list(dict.fromkeys(pieces))
