"""Pure reinforcement-learning math: losses, advantages, staleness control and sequence packing.

Everything here is a pure function (jnp arrays in and out, numpy for host-side packing), jit- and
grad-able where it runs on device; the stateful parts of the system live elsewhere.
"""

from areal_jax.rl.advantages import gae, group_advantages, no_eos_mask, overlong_penalty, shape_rewards
from areal_jax.rl.losses import (
    aggregate,
    decoupled_ppo_loss,
    gspo_loss,
    kl_penalty,
    ppo_loss,
    token_entropy,
    token_logprobs,
    value_loss,
)
from areal_jax.rl.packing import (
    balanced_microbatches,
    microbatch_balance,
    pack_sequences,
    pack_values,
    unpack_values,
)
from areal_jax.rl.staleness import rollout_capacity, sample_staleness, staleness_mask

__all__ = [
    "aggregate",
    "balanced_microbatches",
    "decoupled_ppo_loss",
    "gae",
    "group_advantages",
    "gspo_loss",
    "kl_penalty",
    "microbatch_balance",
    "no_eos_mask",
    "overlong_penalty",
    "pack_sequences",
    "pack_values",
    "ppo_loss",
    "rollout_capacity",
    "sample_staleness",
    "shape_rewards",
    "staleness_mask",
    "token_entropy",
    "token_logprobs",
    "unpack_values",
    "value_loss",
]
