"""reward.fn=mixed: math and programming tasks in one run (data.train_tasks / data.test_tasks), each completion
scored by its task's reward. A programming task's answer is its hidden tests in the code_tests format (a JSON
object whose "format" is rewards.code_tests.TESTS_FORMAT); every other answer is a math reference answer."""
from __future__ import annotations

import json
from typing import Any, Callable

from areal_jax.rewards.code_tests import TESTS_FORMAT


def is_code_answer(answer: str) -> bool:
    """Whether ``answer`` holds a programming task's hidden tests (not a math reference answer)."""
    text = answer.lstrip()
    if not text.startswith("{") or TESTS_FORMAT not in text[:4096]:
        return False
    try:
        tests = json.loads(text)
    except ValueError:
        return False
    return isinstance(tests, dict) and tests.get("format") == TESTS_FORMAT


def mixed_reward(completion: str, answer: str, *, code_reward: Callable[[str, str], float],
                 math_reward: Any = "areal_jax.rewards.math:math_reward") -> float:
    """code_reward(completion, answer) for a programming task's tests, else the math reward (a callable, or an
    importable "module:function")."""
    if is_code_answer(answer):
        return code_reward(completion, answer)
    if isinstance(math_reward, str):
        import importlib

        module, name = math_reward.split(":")
        math_reward = getattr(importlib.import_module(module), name)
    return math_reward(completion, answer)
