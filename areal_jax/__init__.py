"""areal_jax: asynchronous reinforcement learning for language-model reasoning, in JAX."""

__version__ = "0.1.0"
