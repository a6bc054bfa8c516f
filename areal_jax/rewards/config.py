"""RewardConfig: the `reward` section of a job's config (what scores a completion, and the pool that runs it).

The job builds its RewardPool (rewards/pool.py) from it with ``config.make_pool()``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

from areal_jax.knobs import Section, knob, require

REWARD_FUNCTIONS = {
    "math": "areal_jax.rewards.math:math_reward",
    "exact": "areal_jax.rewards.exact:exact_match_reward",
}


# What a new math-reward worker scores first (see RewardConfig.make_pool).
MATH_REWARD_WARMUP = ("\\boxed{\\frac{1}{2}}", "0.5")


@dataclass(frozen=True)
class RewardConfig(Section):
    """What scores a completion and the pool that runs it (the config's `reward` section)."""

    section: ClassVar[str] = "reward"

    fn: str = knob("math", "math | exact | code | mixed (math rows by math, programming tasks by code: "
                           "data.train_tasks) | module:function (a function (completion, answer) -> float)")
    num_workers: int = knob(2, "reward worker processes")
    timeout_s: float = knob(5.0, "wall-clock limit per sample; a worker past it is killed and the sample scores 0")
    memory_mb: int = knob(4096, "address-space limit per reward worker; 0 = none")
    cache_size: int = knob(16384, "identical (completion, answer) pairs are scored once: an LRU of this many scored "
                           "pairs, and repeats of a pair being scored wait for its result; 0 = score every "
                           "sample (for rewards with randomness)")
    code_mode: str = knob("all_pass", "reward.fn=code: all_pass (1 iff every test passes) | pass_rate",
                          choices=("all_pass", "pass_rate"))
    code_case_timeout_s: float = knob(4.0, "reward.fn=code: wall-clock limit per test case")
    code_sample_timeout_s: float = knob(20.0, "reward.fn=code: limit for all cases of one sample")
    code_allow_numpy: bool = knob(False, "reward.fn=code: programs may import numpy (without ctypes); its array "
                                  "interface reaches any address of the sandboxed process, which the sandbox's "
                                  "kernel-enforced layers (Landlock, namespaces, limits) still hold")
    code_output_match: str = knob("numbers", "reward.fn=code: how a stdin case's output is compared, unless its "
                                  "row names its own: numbers (tokens; a real within 1e-6 abs or rel, YES / NO in any "
                                  "case) | tokens "
                                  "(whitespace-separated tokens) | lines (line by line, trailing spaces ignored)",
                                  choices=("numbers", "tokens", "lines"))
    code_time_limit_factor: float = knob(0.0, "reward.fn=code: > 0 gives a task that states its contest's time limit "
                                         "(CodeContests, TACO) min(code_case_timeout_s, factor x that limit) per "
                                         "case; 0 = every case gets code_case_timeout_s")
    code_require_landlock: bool = knob(False, "reward.fn=code: refuse to start where the kernel has no Landlock; "
                                       "without it the sandbox's file and execve rules rest on an audit hook that "
                                       "pure Python can switch off")

    def check(self) -> None:
        k = self.key
        require(self.timeout_s > 0, f"{k('timeout_s')}={self.timeout_s} must be positive.")
        require(self.num_workers >= 1, f"{k('num_workers')}={self.num_workers} must be >= 1.")
        require(self.cache_size >= 0, f"{k('cache_size')}={self.cache_size} must be >= 0 (0 = no cache).")
        require(self.memory_mb >= 0, f"{k('memory_mb')}={self.memory_mb} must be >= 0 (0 = no limit).")
        require(self.fn in REWARD_FUNCTIONS or self.fn in ("code", "mixed") or ":" in self.fn,
                f"{k('fn')}={self.fn!r} is neither a built-in ({', '.join(REWARD_FUNCTIONS)}, code, mixed) nor an "
                "importable 'module:function' path.")
        if self.fn in ("code", "mixed"):
            require(self.code_time_limit_factor >= 0,
                    f"{k('code_time_limit_factor')}={self.code_time_limit_factor} must be >= 0 (0: tasks' own time "
                    "limits unused).")
            require(self.code_case_timeout_s > 0 and self.code_sample_timeout_s > 0,
                    f"{k('code_case_timeout_s')} and {k('code_sample_timeout_s')} must be positive.")
            require(self.timeout_s > self.code_sample_timeout_s,
                    f"{k('timeout_s')}={self.timeout_s} must exceed {k('code_sample_timeout_s')}="
                    f"{self.code_sample_timeout_s} (the pool kills a sample at timeout_s, before its tests can finish).")
            if self.code_require_landlock:
                from areal_jax.rewards.isolation import landlock_abi

                require(landlock_abi() > 0,
                        f"{k('code_require_landlock')}=True, but this kernel ({os.uname().release}) enforces no "
                        "Landlock: run on Linux >= 5.13 booted with landlock among its LSMs (the lsm= boot "
                        f"parameter), or set {k('code_require_landlock')}=False to accept the audit hook alone.")

    def make_pool(self) -> Any:
        """The RewardPool these options describe. With fn=math every new worker (also one replacing a
        worker killed at a timeout) scores a LaTeX answer before it takes samples, so sympy's import
        never counts against a sample's timeout."""
        from areal_jax.rewards.pool import RewardPool

        return RewardPool(self.scorer(), num_workers=self.num_workers, timeout_s=self.timeout_s,
                          warmup=MATH_REWARD_WARMUP if self.fn in ("math", "mixed") else None,
                          memory_mb=self.memory_mb or None, cache_size=self.cache_size)

    def scorer(self) -> Any:
        """What the RewardPool runs: an importable "module:function" string, or for fn=code the sandboxed
        test reward (rewards/code.py) with code_mode and its time limits bound in (fn=mixed: that or the math reward,
        by each row's answer; rewards/mixed.py)."""
        if self.fn in ("code", "mixed"):
            from areal_jax.rewards.code import make_code_reward

            code = make_code_reward(self.code_mode, self.code_case_timeout_s, self.code_sample_timeout_s,
                                    allow_numpy=self.code_allow_numpy, output_match=self.code_output_match,
                                    time_limit_factor=self.code_time_limit_factor)
            if self.fn == "mixed":  # math rows by the math reward, programming tasks by the sandbox
                import functools

                from areal_jax.rewards.mixed import mixed_reward

                return functools.partial(mixed_reward, code_reward=code, math_reward=REWARD_FUNCTIONS["math"])
            return code
        return REWARD_FUNCTIONS.get(self.fn, self.fn)
