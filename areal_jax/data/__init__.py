"""Data: JSONL / Parquet readers, prompt formatting, the grain prompt stream, synthetic math problems."""
from areal_jax.data.pipeline import (
    PromptIterator,
    PromptSource,
    load_eval_split,
    load_prompt_source,
    make_prompt_iterator,
)
from areal_jax.data.prompts import DEFAULT_PROMPT_TEMPLATE, PromptExample, PromptFormat
from areal_jax.data.readers import ReadStats, Record, extract_reference_answer, read_jsonl, read_parquet, read_records

__all__ = [
    "DEFAULT_PROMPT_TEMPLATE", "PromptExample", "PromptFormat", "PromptIterator", "PromptSource", "ReadStats",
    "Record", "extract_reference_answer", "load_eval_split", "load_prompt_source", "make_prompt_iterator", "read_jsonl", "read_parquet",
    "read_records",
]
