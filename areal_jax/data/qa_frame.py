"""The "Question: ...\nAnswer:" frame of the embedded small models (math and code), and the word-level tokenizers
built over it: special tokens <pad> (0), <bos> (1), <eos> (2), <unk> (3), then the task's pieces.

``frame_tokenizer(pieces, pattern)``: a tokenizers.Tokenizer that splits text at every match of ``pattern`` (one
piece each), looks the piece up (unknown: <unk>), prepends <bos> with ``add_special_tokens=True`` and decodes by
concatenation; its chat template renders the same frame: "<bos>Question: ...\nAnswer: <answer><eos>".
"""
from __future__ import annotations

from typing import Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from areal_jax.tokenizer import Tokenizer

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)

# Equal to the data pipeline's default template.
QA_PROMPT_TEMPLATE = "Question: {question}\nAnswer:"


def qa_chat_template(task: str) -> str:
    """The chat template of the frame; `task` names the format in the error a system turn raises."""
    return (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{% if message['role'] == 'user' %}"
        "{{ 'Question: ' + message['content'] + '\n' }}"
        "{% elif message['role'] == 'assistant' %}"
        "{{ 'Answer: ' + message['content'] + eos_token }}"
        "{% else %}"
        f"{{{{ raise_exception('The {task} prompt format has only user and assistant turns, got role ' + "
        "message['role']) }}"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Answer:' }}{% endif %}"
    )


def frame_tokenizer(pieces: Sequence[str], pattern: str, task: str) -> Tokenizer:
    """The tokenizer over SPECIAL_TOKENS + `pieces` (the task's vocabulary, in id order after the specials)."""
    vocab = {piece: i for i, piece in enumerate((*SPECIAL_TOKENS, *pieces))}
    if len(vocab) != len(SPECIAL_TOKENS) + len(pieces):
        raise ValueError(f"the {task} vocabulary repeats a piece or a special token")
    backend = tokenizers.Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return Tokenizer(backend, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                     chat_template=qa_chat_template(task))
