"""A small byte-level BPE tokenizer trained on the spot: what tests of chat templates and tokenization build on."""
from __future__ import annotations

from typing import Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers


def byte_level_bpe(corpus: Sequence[str], special_tokens: Sequence[str], vocab_size: int = 300) -> tokenizers.Tokenizer:
    """A byte-level BPE backend (GPT-2 / Qwen style, no prefix space) trained on ``corpus`` with ``special_tokens``."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus), trainer)
    return tok
