"""A character-level tokenizer for small code models: one token per printable ASCII character.

Vocabulary: <pad> (0), <bos> (1), <eos> (2), <unk> (3), then the 95 printable ASCII characters (space to
"~") and the newline: 100 tokens. Any other character encodes as <unk>. Decoding concatenates
characters, so every ASCII program round-trips exactly.
"""
from __future__ import annotations

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from areal_jax.tokenizer import Tokenizer

__all__ = ["build_code_tokenizer", "CODE_CHAT_TEMPLATE", "CODE_PROMPT_TEMPLATE", "CODE_VOCAB"]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CODE_VOCAB: tuple[str, ...] = (PAD, BOS, EOS, UNK, *[chr(i) for i in range(32, 127)], "\n")

# The prompt frame of the synthetic tasks (equal to the data pipeline's default template).
CODE_PROMPT_TEMPLATE = "Question: {question}\nAnswer:"

# A chat template rendering the same frame: "<bos>Question: ...\nAnswer: <program><eos>".
CODE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}"
    "{{ 'Question: ' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ 'Answer: ' + message['content'] + eos_token }}"
    "{% else %}"
    "{{ raise_exception('The code prompt format has only user and assistant turns, got role ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Answer:' }}{% endif %}"
)


def build_code_tokenizer() -> Tokenizer:
    """The character-level tokenizer; ``encode(text, add_special_tokens=True)`` prepends <bos>."""
    vocab = {piece: i for i, piece in enumerate(CODE_VOCAB)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t in (PAD, BOS, EOS, UNK)])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return Tokenizer(backend, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                     chat_template=CODE_CHAT_TEMPLATE)
