"""Prompt formatting: a plain template with {question}, or the tokenizer's chat template.

Prompts are tokenized once, when a dataset is loaded; prompts longer than ``max_prompt_len`` tokens are
skipped and counted, or rejected with an error, by option.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from areal_jax.data.readers import Record
from areal_jax.tokenizer import Tokenizer

__all__ = ["DEFAULT_PROMPT_TEMPLATE", "PromptExample", "PromptFormat", "tokenize_records"]

DEFAULT_PROMPT_TEMPLATE = "Question: {question}\nAnswer:"
_PLACEHOLDER = "{question}"


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """One prompt for rollout or evaluation.

    uid: stable id "<file name>:<row>:<epoch>" (row: 1-based JSONL line or 0-based Parquet index).
    prompt_tokens: the tokenized prompt, list[int] of length <= max_prompt_len.
    answer: the reference answer (for GSM8K, the text after "####").
    question: the raw question text.
    """
    uid: str
    prompt_tokens: list[int]
    answer: str
    question: str


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How a question becomes a prompt.

    template: plain-text template holding "{question}" once (other braces are kept literally); used
      when use_chat_template is False.
    use_chat_template: render [system?, user] with the tokenizer's chat template and its generation
      prompt; the user turn is ``chat_user_template`` with the question substituted.
    system_prompt: optional system turn (chat template only); None or "" means none.
    add_special_tokens: for plain templates, let the tokenizer add its special tokens (e.g. a BOS), as
      ``tokenizer(text)`` does in transformers. Chat templates add their own and are never post-processed.
    """
    template: str = DEFAULT_PROMPT_TEMPLATE
    use_chat_template: bool = False
    system_prompt: str | None = None
    chat_user_template: str = _PLACEHOLDER
    add_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("template", "chat_user_template"):
            value = getattr(self, name)
            if value.count(_PLACEHOLDER) != 1:
                raise ValueError(f"The prompt {name} must contain {_PLACEHOLDER} exactly once, got {value!r}.")
        if self.system_prompt and not self.use_chat_template:
            raise ValueError("system_prompt needs use_chat_template=True; with a plain template, write the "
                             "instructions into the template itself.")

    def render(self, tokenizer: Tokenizer, question: str) -> str:
        """The prompt text for ``question``."""
        if not self.use_chat_template:
            return self.template.replace(_PLACEHOLDER, question)
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": self.chat_user_template.replace(_PLACEHOLDER, question)})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert isinstance(text, str)
        return text

    def encode_many(self, tokenizer: Tokenizer, questions: Sequence[str]) -> list[list[int]]:
        """Token ids of each question's prompt."""
        if self.use_chat_template and tokenizer.chat_template is None:
            raise ValueError("use_chat_template=True but the tokenizer has no chat template; use a plain "
                             "prompt template instead.")
        texts = [self.render(tokenizer, q) for q in questions]
        special = self.add_special_tokens and not self.use_chat_template
        return tokenizer.batch_encode(texts, add_special_tokens=special)


def tokenize_records(records: Sequence[Record], tokenizer: Tokenizer, prompt_format: PromptFormat,
                     max_prompt_len: int | None = None,
                     on_too_long: str = "skip") -> tuple[list[tuple[Record, list[int]]], int]:
    """Tokenizes every record's prompt and drops those over ``max_prompt_len`` tokens.

    Returns ([(record, prompt_tokens)], number skipped as too long). With on_too_long="error" an
    over-long prompt raises a ValueError naming its file and row instead.
    """
    if on_too_long not in ("skip", "error"):
        raise ValueError(f"on_too_long must be 'skip' or 'error', got {on_too_long!r}.")
    if max_prompt_len is not None and max_prompt_len < 1:
        raise ValueError(f"max_prompt_len must be a positive number of tokens or None, got {max_prompt_len}.")
    token_lists = prompt_format.encode_many(tokenizer, [r.question for r in records])
    kept, too_long = [], 0
    for record, tokens in zip(records, token_lists):
        if max_prompt_len is not None and len(tokens) > max_prompt_len:
            if on_too_long == "error":
                raise ValueError(f"{record.source}, row {record.row}: the prompt has {len(tokens)} tokens, more "
                                 f"than max_prompt_len={max_prompt_len}. Raise max_prompt_len or pass "
                                 f"on_too_long='skip'.")
            too_long += 1
            continue
        kept.append((record, tokens))
    return kept, too_long
