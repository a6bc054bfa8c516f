"""Flax NNX decoder family (Qwen2, Qwen3, Llama), HF safetensors in/out and sharding rules."""
from areal_jax.models.config import ModelConfig
from areal_jax.models.transformer import KVCache, Transformer, init_cache

__all__ = ["ModelConfig", "Transformer", "KVCache", "init_cache"]
