"""Exact-match reward: the completion's final answer equals the reference after string normalisation.

Cheaper and stricter than ``math_reward``: ``0.5`` and ``1/2`` differ here. Use it for answers that are
words or labels (multiple choice letters, names) or as a sanity baseline for the math checker.
"""

from __future__ import annotations

import re

from areal_jax.rewards.math import extract_final_answer, reference_answer

__all__ = ["normalize_answer", "exact_match_reward"]

_TEXT_WRAPPER = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{(.*)\}$", re.DOTALL)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")
_SPACES = re.compile(r"\s+")


def normalize_answer(text: str) -> str:
    """Canonical form of an answer string for exact comparison.

    Lower-cases; strips surrounding whitespace, ``$`` signs, a ``\\text{...}``-style wrapper and a
    trailing period; removes thousands separators between digits (``1,000`` -> ``1000``); collapses
    runs of whitespace to one space. ``" $\\text{Paris}$. "`` -> ``"paris"``.
    """
    s = text.strip()
    while True:
        before = s
        s = s.strip().strip("$").strip()
        m = _TEXT_WRAPPER.match(s)
        if m:
            s = m.group(1)
        s = s.rstrip(".").strip()
        if s == before:
            break
    s = _THOUSANDS.sub("", s)
    return _SPACES.sub(" ", s).lower()


def exact_match_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer (see ``extract_final_answer``) equals the reference
    after ``normalize_answer`` on both sides, else 0.0. Never raises."""
    try:
        pred = extract_final_answer(completion)
        if pred is None or not isinstance(answer, str):
            return 0.0
        return 1.0 if normalize_answer(pred) == normalize_answer(reference_answer(answer)) else 0.0
    except Exception:  # noqa: BLE001 - a reward must never take the run down
        return 0.0
