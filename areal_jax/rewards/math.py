"""Math answer checking: find a completion's final answer and compare it to a reference.

The final answer of a completion is, in order of preference:
  1. the content of the last balanced ``\\boxed{...}``,
  2. the rest of the line after the last ``####`` (GSM8K style),
  3. the rest of the sentence after the last "the answer is" (case-insensitive),
  4. the last number in the text (``-12``, ``1,000``, ``3.5``, ``3/4``).

Equality is mathematical (math-verify + sympy): ``1/2 == 0.5 == \\frac{1}{2}`` and ``1,000 == 1000``.
Plain numbers on both sides, the common case for GSM8K-style data, are compared exactly with
``fractions.Fraction`` without touching sympy; against a plain-number reference, a number followed by words only
(its unit: ``12 dollars``, ``3.5 km per hour``) counts as that number.

math-verify's own timeouts use ``signal.alarm`` and fail off the main thread, so they are disabled
here; run ``math_reward`` under ``areal_jax.rewards.pool.RewardPool``, whose per-sample timeout kills
a stuck worker process.
"""

from __future__ import annotations

import logging
import re
from fractions import Fraction

# math_verify warns once per process that its signal-based timeouts are off; the RewardPool's per-sample
# timeout replaces them, so the warning is noise in every worker's output.
logging.getLogger("math_verify").setLevel(logging.ERROR)

__all__ = [
    "extract_final_answer",
    "math_reward",
    "parse_plain_number",
    "reference_answer",
    "answers_equal",
]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS = re.compile(r"the\s+(?:final\s+)?answer\s+is\s*:?", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
_NUMBER = re.compile(
    r"(?<![\w.])-?\d+(?:,\d{3}(?!\d))*(?:\.\d+)?(?:\s*/\s*\d+)?|(?<![\w.])-?\.\d+")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")
# A plain number followed by words only (a unit: "12 dollars", "3.5 km per hour", "40 %"), against a plain reference.
_NUMBER_AND_UNIT = re.compile(r"\$?\s*([-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+))\s*(?:\\?%|[A-Za-z][A-Za-z'./ ]*)")


def _last_balanced_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance, or None if there is none."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
        # Unbalanced (e.g. a truncated completion): try the previous one.
    return None


def extract_final_answer(text: str) -> str | None:
    """The final answer of a completion as a string, or None when it has none.

    See the module docstring for the order of the rules. Whitespace around the answer, a leading
    ``:``/``=`` and a trailing period are removed; the answer's own content is kept as written.
    """
    if not isinstance(text, str) or not text:
        return None
    boxed = _last_balanced_boxed(text)
    if boxed:
        return boxed
    if "####" in text:
        rest = text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
        rest = rest.rstrip(".").strip()
        if rest:
            return rest
    matches = list(_ANSWER_IS.finditer(text))
    if matches:
        rest = text[matches[-1].end():].split("\n", 1)[0]
        end = _SENTENCE_END.search(rest)
        if end is not None:
            rest = rest[: end.start()]
        rest = rest.strip().lstrip(":=").strip().rstrip(".").strip()
        if rest:
            return rest
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1].replace(" ", "")
    return None


def _plain_spelling(text: str) -> str:
    """``text`` without what dresses a plain number but is not part of it: markdown emphasis (``**42**``), an escaped
    or bare dollar sign (``\\$18``, ``$72$``) and the thousands spacing of LaTeX or typography (``1\\,000``,
    ``1{,}000``, a no-break or thin space)."""
    s = text.strip().strip("*_").strip()
    s = s.replace("\\$", "$").replace("{,}", ",").replace("\\,", "").replace("\\!", "")
    s = re.sub(r"[\u00a0\u2009\u202f]", "", s)
    return s.strip().strip("$").strip()


def parse_plain_number(text: str) -> Fraction | None:
    """Exact value of a plain number string (``-3``, ``1,000``, ``0.5``, ``3/4``, ``$72$``, ``72.``, ``**72**``,
    ``\\$72``, ``1\\,000``), or None when the string is anything else (LaTeX, units, expressions)."""
    s = _plain_spelling(text)
    s = _THOUSANDS.sub("", s).replace(" ", "")
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1]
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        if "/" in s:
            num, den = s.split("/")
            if int(den) == 0:
                return None
            return Fraction(num) / Fraction(den)
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def reference_answer(answer: str) -> str:
    """The answer to compare against: a reference that itself holds a ``\\boxed{}`` or ``####``
    (e.g. a full GSM8K solution) is reduced to its final answer; anything else is used as given."""
    if "####" in answer or _BOXED.search(answer):
        extracted = extract_final_answer(answer)
        if extracted is not None:
            return extracted
    return answer.strip()


def _as_latex(s: str) -> str:
    """Wrap a bare answer in ``$...$`` so math-verify's LaTeX extractor sees all of it."""
    return s if "$" in s or "\\boxed" in s else f"${s}$"


def answers_equal(pred: str, gold: str) -> bool:
    """Whether two answer strings are mathematically equal.

    Plain numbers are compared exactly without sympy; anything else goes through math-verify's
    ``parse``/``verify`` with their signal-based timeouts disabled (callers bound the time).
    """
    a, b = parse_plain_number(pred), parse_plain_number(gold)
    if a is None and b is not None and (unit := _NUMBER_AND_UNIT.fullmatch(_plain_spelling(pred))):
        a = parse_plain_number(unit.group(1))  # "12 dollars", "$12.50 per hour", "5 %": the number is the answer
    if a is not None and b is not None:
        return a == b
    from math_verify import parse, verify  # imported lazily: sympy is slow to import

    gold_parsed = parse(_as_latex(gold), parsing_timeout=None)
    pred_parsed = parse(_as_latex(pred), parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return pred.strip() == gold.strip()
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def math_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer equals the reference answer mathematically, else 0.0.

    Never raises: a completion without an answer, unparsable LaTeX or any internal error scores 0.0.
    """
    try:
        pred = extract_final_answer(completion)
        if pred is None or not isinstance(answer, str):
            return 0.0
        return 1.0 if answers_equal(pred, reference_answer(answer)) else 0.0
    except Exception:  # noqa: BLE001 - a reward must never take the run down
        return 0.0
