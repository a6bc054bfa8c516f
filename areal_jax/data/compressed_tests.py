"""LiveCodeBench's compressed test cases (base64 of zlib of a pickled JSON string), decoded without running anything.

A pickle runs code by naming a class or function to call; the unpickler here refuses every such name before anything
is looked up, so only plain values come out, and the decompressed size is bounded.
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import pickle
import zlib
from typing import Any

from areal_jax.data.readers import _BadRow

__all__ = ["decode_compressed_cases", "MAX_DECOMPRESSED_BYTES"]

# The most a compressed test field may decompress to (LiveCodeBench's largest rows hold tens of MB of tests).
MAX_DECOMPRESSED_BYTES = 1 << 30


class _PlainDataUnpickler(pickle.Unpickler):
    """Builds plain values (str, bytes, numbers, lists, tuples, dicts, sets) only. A pickle runs code by naming a
    class or function to call (GLOBAL / STACK_GLOBAL / extension opcodes, all resolved by ``find_class``) or
    through ``persistent_load``: both are refused before anything is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        raise _BadRow(f"field 'private_test_cases' is a pickle naming {module:.40}.{name:.40}; only plain data "
                      "(a JSON string or a list) is read from it, nothing is called")

    def persistent_load(self, pid: Any) -> Any:
        raise _BadRow("field 'private_test_cases' is a pickle with persistent ids; only plain data is read")


def decode_compressed_cases(text: str) -> Any:
    """LiveCodeBench's compressed test cases: base64 of zlib of a pickled JSON string -> the decoded JSON value.
    Decoded with ``_PlainDataUnpickler`` and at most MAX_DECOMPRESSED_BYTES; anything else is a _BadRow."""
    what = "field 'private_test_cases'"
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise _BadRow(f"{what} is neither a JSON list nor base64") from None
    inflate = zlib.decompressobj()
    try:
        data = inflate.decompress(raw, MAX_DECOMPRESSED_BYTES)
    except zlib.error as e:
        raise _BadRow(f"{what} is base64 but not zlib-compressed ({e})") from None
    if inflate.unconsumed_tail:
        raise _BadRow(f"{what} decompresses to more than {MAX_DECOMPRESSED_BYTES >> 20} MiB")
    try:
        value = _PlainDataUnpickler(io.BytesIO(data)).load()
    except _BadRow:
        raise
    except Exception as e:  # truncated or not a pickle at all
        raise _BadRow(f"{what} decompresses to something that is not a pickle ({type(e).__name__})") from None
    if isinstance(value, (str, bytes)):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise _BadRow(f"{what} holds a string that is not JSON ({e.msg} at column {e.colno})") from None
    return value
