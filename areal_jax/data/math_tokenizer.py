"""A word-level tokenizer for the synthetic arithmetic word problems (a few dozen tokens).

Pieces are words with their leading space (" buys"), bare words that start a line ("Question"), single
digits (numbers are split digit by digit, so "57" is "5", "7" and " 57" is " 5", "7"), symbols, and
"####". Decoding concatenates pieces, so every generated question and solution round-trips exactly.
"""
from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from areal_jax.data import math_words
from areal_jax.tokenizer import Tokenizer

__all__ = ["build_math_tokenizer", "MATH_CHAT_TEMPLATE", "MATH_PROMPT_TEMPLATE"]

# The prompt frame used for the synthetic problems; equal to the data pipeline's default template.
MATH_PROMPT_TEMPLATE = "Question: {question}\nAnswer:"

# A tiny chat template rendering the same frame: "<bos>Question: ...\nAnswer: <solution><eos>".
MATH_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ 'Question: ' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ 'Answer: ' + message['content'] + eos_token }}"
    "{% else %}"
    "{{ raise_exception('The math prompt format has only user and assistant turns, got role ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Answer:' }}{% endif %}"
)

# One piece per match: an optionally space-led word, an optionally space-led digit, an optionally
# space-led "####", a symbol, a newline. Anything else (double spaces, unknown symbols) becomes <unk>.
_PIECE_PATTERN = r" ?[A-Za-z]+| ?[0-9]| ?####|[^\sA-Za-z0-9]|\n"


def build_math_tokenizer() -> Tokenizer:
    """Returns the word-level tokenizer of the synthetic math problems.

    Special tokens: <pad> (id 0), <bos> (1), <eos> (2), <unk> (3). ``encode(text, add_special_tokens=True)``
    prepends <bos>; the chat template renders "<bos>Question: {q}\\nAnswer:".
    """
    vocab = {piece: i for i, piece in enumerate(math_words.vocabulary())}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=math_words.UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(_PIECE_PATTERN), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t in math_words.SPECIAL_TOKENS])
    bos = math_words.BOS
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])])
    return Tokenizer(backend, bos_token=bos, eos_token=math_words.EOS, pad_token=math_words.PAD,
                     unk_token=math_words.UNK, chat_template=MATH_CHAT_TEMPLATE)
