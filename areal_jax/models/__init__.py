"""Flax NNX decoder family (Qwen2, Qwen3, Llama), HF safetensors in/out and sharding rules."""
from areal_jax.models.config import ModelConfig
from areal_jax.models.flat_params import FlatParams, as_tree
from areal_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from areal_jax.models.sharding import LOGICAL_AXIS_RULES, logical_to_mesh_sharding, shard_params
from areal_jax.models.transformer import KVCache, Transformer, init_cache

__all__ = [
    "ModelConfig",
    "Transformer",
    "KVCache",
    "FlatParams",
    "as_tree",
    "init_cache",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "LOGICAL_AXIS_RULES",
    "logical_to_mesh_sharding",
    "shard_params",
]
