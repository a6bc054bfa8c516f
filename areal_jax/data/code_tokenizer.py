"""A character-level tokenizer for small code models: one token per printable ASCII character.

Vocabulary: <pad> (0), <bos> (1), <eos> (2), <unk> (3), then the 95 printable ASCII characters (space to
"~") and the newline: 100 tokens. Any other character encodes as <unk>. Decoding concatenates
characters, so every ASCII program round-trips exactly.
"""
from __future__ import annotations

from areal_jax.data.qa_frame import QA_PROMPT_TEMPLATE, SPECIAL_TOKENS, frame_tokenizer, qa_chat_template
from areal_jax.tokenizer import Tokenizer

__all__ = ["build_code_tokenizer", "CODE_CHAT_TEMPLATE", "CODE_PROMPT_TEMPLATE", "CODE_VOCAB"]

CODE_VOCAB: tuple[str, ...] = (*SPECIAL_TOKENS, *[chr(i) for i in range(32, 127)], "\n")

# The prompt frame of the synthetic tasks (equal to the data pipeline's default template), and its chat template:
# "<bos>Question: ...\nAnswer: <program><eos>".
CODE_PROMPT_TEMPLATE = QA_PROMPT_TEMPLATE
CODE_CHAT_TEMPLATE = qa_chat_template("code")


def build_code_tokenizer() -> Tokenizer:
    """The character-level tokenizer; ``encode(text, add_special_tokens=True)`` prepends <bos>."""
    return frame_tokenizer(CODE_VOCAB[len(SPECIAL_TOKENS):], r"[\s\S]", "code")
