"""Pure reinforcement-learning math: losses (per-token forms and one aggregation), advantages, staleness control and sequence packing.

Everything here is a pure function (jnp arrays in and out, numpy for host-side packing), jit- and
grad-able where it runs on device; the stateful parts of the system live elsewhere.
"""

from areal_jax.rl.advantages import gae, group_advantages, overlong_penalty
from areal_jax.rl.aggregation import aggregate, segment_mean, token_weights
from areal_jax.rl.losses import (
    decoupled_ppo_loss,
    decoupled_ppo_token_loss,
    gspo_loss,
    gspo_token_loss,
    kl_penalty,
    kl_token_penalty,
    policy_stats,
    ppo_loss,
    ppo_token_loss,
    token_entropy,
    token_logprobs,
    value_loss,
    value_token_loss,
)
from areal_jax.rl.packing import balanced_microbatches, microbatch_balance
from areal_jax.rl.staleness import rollout_capacity, sample_staleness, staleness_mask

__all__ = [
    "aggregate",
    "balanced_microbatches",
    "decoupled_ppo_loss",
    "decoupled_ppo_token_loss",
    "gae",
    "group_advantages",
    "gspo_loss",
    "gspo_token_loss",
    "kl_penalty",
    "kl_token_penalty",
    "microbatch_balance",
    "overlong_penalty",
    "policy_stats",
    "ppo_loss",
    "ppo_token_loss",
    "rollout_capacity",
    "sample_staleness",
    "segment_mean",
    "staleness_mask",
    "token_entropy",
    "token_logprobs",
    "token_weights",
    "value_loss",
    "value_token_loss",
]
