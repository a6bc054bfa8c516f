"""A word-level tokenizer for the synthetic arithmetic word problems (a few dozen tokens).

Pieces are words with their leading space (" buys"), bare words that start a line ("Question"), single
digits (numbers are split digit by digit, so "57" is "5", "7" and " 57" is " 5", "7"), symbols, and
"####". Decoding concatenates pieces, so every generated question and solution round-trips exactly.
"""
from __future__ import annotations

from areal_jax.data import math_words
from areal_jax.data.qa_frame import QA_PROMPT_TEMPLATE, SPECIAL_TOKENS, frame_tokenizer, qa_chat_template
from areal_jax.tokenizer import Tokenizer

__all__ = ["build_math_tokenizer", "MATH_CHAT_TEMPLATE", "MATH_PROMPT_TEMPLATE"]

# The prompt frame used for the synthetic problems (equal to the data pipeline's default template), and its chat
# template: "<bos>Question: ...\nAnswer: <solution><eos>".
MATH_PROMPT_TEMPLATE = QA_PROMPT_TEMPLATE
MATH_CHAT_TEMPLATE = qa_chat_template("math")

# One piece per match: an optionally space-led word, an optionally space-led digit, an optionally
# space-led "####", a symbol, a newline. Anything else (double spaces, unknown symbols) becomes <unk>.
_PIECE_PATTERN = r" ?[A-Za-z]+| ?[0-9]| ?####|[^\sA-Za-z0-9]|\n"


def build_math_tokenizer() -> Tokenizer:
    """Returns the word-level tokenizer of the synthetic math problems.

    Special tokens: <pad> (id 0), <bos> (1), <eos> (2), <unk> (3). ``encode(text, add_special_tokens=True)``
    prepends <bos>; the chat template renders "<bos>Question: {q}\\nAnswer:".
    """
    pieces = math_words.vocabulary()
    if tuple(pieces[:len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
        raise ValueError("math_words.vocabulary() must start with the special tokens <pad> <bos> <eos> <unk>")
    return frame_tokenizer(pieces[len(SPECIAL_TOKENS):], _PIECE_PATTERN, "math")
