"""Rewards computed off the accelerator: math answer checking (math-verify), exact match, a process
pool with per-sample timeouts, and a sandbox for code-execution rewards.

Importing this package is cheap: sympy / math-verify load on the first non-numeric comparison.
"""

from areal_jax.rewards.exact import exact_match_reward, normalize_answer
from areal_jax.rewards.math import extract_final_answer, math_reward
from areal_jax.rewards.pool import RewardPool, RewardResult
from areal_jax.rewards.sandbox import SandboxResult, code_reward, run_python_sandboxed

__all__ = [
    "RewardPool",
    "RewardResult",
    "SandboxResult",
    "code_reward",
    "exact_match_reward",
    "extract_final_answer",
    "math_reward",
    "normalize_answer",
    "run_python_sandboxed",
]
