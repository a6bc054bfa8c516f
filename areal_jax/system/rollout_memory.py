"""What the rollout side of the memory plan holds on one rollout device, from shapes (`system.memory` adds these
parts up with the trainer's): the sampler's KV cache (a dense cache or a page pool, with the standby rows and the
decode logits), the sampler's weights and the next version's during a hand-off, and what an evaluation adds."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.flat_params import cast_shapes
from areal_jax.models.mixers import kind
from areal_jax.models.mla import cache_layout
from areal_jax.models.sharding import logical_to_mesh_sharding
from areal_jax.models.transformer import cache_dtype, cache_lengths, ring_layers
from areal_jax.trainer.memory import per_device_bytes


def kv_position_bytes(cfg: ModelConfig, tensor: int, split: bool = True, layers: int | None = None) -> int:
    """Keys and values of one position in `layers` layers (default every layer) on one device (kv heads split over
    `tensor` when `split` and they divide)."""
    layers = cfg.num_layers if layers is None else layers
    heads, k_dim, v_dim = cache_layout(cfg)
    per_position = layers * heads * (k_dim + v_dim) * cache_dtype(cfg).itemsize
    return per_position // tensor if split and tensor > 1 and heads % tensor == 0 else per_position


def row_state_bytes(cfg: ModelConfig, tensor: int) -> int:
    """One row's window and state in one stateful layer on one device (`mixers`' state_buffers): split over `tensor`
    on their third axis (channels, heads) where the sampler splits its cache (the kv heads divide), as it lays them
    out (an axis that does not divide takes its ceiling share)."""
    buffers = jax.eval_shape(lambda: kind(cfg).state_buffers(cfg, 1))
    split = tensor if tensor > 1 and cache_layout(cfg)[0] % tensor == 0 else 1
    return sum(b.dtype.itemsize * int(np.prod(b.shape[:2] + (-(-b.shape[2] // split),) + b.shape[3:])) for b in buffers)


def eval_rollout(job: Any, backend: str) -> Any:
    """One evaluation stream's engine as a RolloutConfig (None when the job does not evaluate): eval.num_slots
    split over the streams, the longest prompt (data.max_prompt_len) + eval.max_new_tokens rounded up to 8 and
    capped at rollout.max_len (as the job's engine), the evaluation's decode steps and standby rows, and only
    prompts to prefill (the weights never change during an evaluation)."""
    e = job.eval
    if not e.enabled:
        return None
    from areal_jax.sampler.config import default_standby_rows

    max_len = min(job.rollout.max_len, -(-(job.data.max_prompt_len + e.max_new_tokens) // 8) * 8)
    per_stream = -(-e.num_slots // e.streams_for(backend))
    steps = e.decode_steps_for(job.rollout.decode_steps, backend)
    return dataclasses.replace(job.rollout, num_slots=per_stream, group_size=1, max_len=max_len, decode_steps=steps,
                               standby_rows=default_standby_rows(per_stream, steps),
                               standby_len=min(max_len, -(-job.data.max_prompt_len // 8) * 8),
                               kv_cache="dense", kv_pages=None, on_update="continue")


def eval_bytes(job: Any, cfg: ModelConfig, tensor: int, weights: int, backend: str) -> int:
    """What an evaluation adds on a rollout device while it runs (at most): a copy of the sampler's weights
    and each stream's decode state (`eval_rollout`: its slots of the longest prompt + eval.max_new_tokens, its
    standby rows and logits). 0 when the job does not evaluate."""
    ev = eval_rollout(job, backend)
    if ev is None:
        return 0
    return weights + job.eval.streams_for(backend) * kv_cache_bytes(cfg, ev, tensor)


def pool_pages(rollout: Any) -> int:
    """Pages of the paged cache's pool: rollout.kv_pages, num_slots x max_len's worth for None, and for -1
    (fill the free memory, `JobMemory.fill_pages`) the least that works, one longest sequence."""
    per_sequence = -(-rollout.max_len // rollout.page_size)
    if rollout.kv_pages == -1:
        return per_sequence
    return rollout.kv_pages if rollout.kv_pages is not None else rollout.num_slots * per_sequence


def kv_cache_bytes(cfg: ModelConfig, rollout: Any, tensor: int) -> int:
    """The sampler's KV cache on one rollout device (keys and values of every layer; a dense cache and a page pool
    split their kv heads over the rollout mesh's tensor axis when they divide), with the standby
    rows' and the decode logits [rows, vocab]. Sliding-window layers keep their slots' window only, as rings
    (`transformer.ring_layers`; a standby row of the dense cache holds its full bucket); a stateful layer
    keeps each row's window and state (`row_state_bytes`)."""
    rows = rollout.num_slots + rollout.standby
    rings = ring_layers(cfg, rollout.max_len)
    lengths = cache_lengths(cfg, rollout.max_len, ring=True)
    ring_positions = sum(lengths[i] for i in rings)  # one row's positions over every ring layer
    layer_position = kv_position_bytes(cfg, tensor, layers=1)
    linear = sum(cfg.layer_is_linear(i) for i in range(cfg.num_layers))  # a fixed state per row, no keys
    stateful = linear + sum(cfg.layer_is_hybrid(i) for i in range(cfg.num_layers))  # (a hybrid layer: keys too)
    row_states = stateful * row_state_bytes(cfg, tensor) if stateful else 0
    full = kv_position_bytes(cfg, tensor, layers=cfg.num_layers - len(rings) - linear)
    if rollout.kv_cache == "paged":
        pool = pool_pages(rollout) * rollout.page_size * full
        return pool + rows * (ring_positions * layer_position + row_states) + rows * cfg.vocab_size * 4
    slots = rollout.num_slots * (rollout.max_len * full + ring_positions * layer_position)
    standby = rollout.standby * rollout.standby_length() * kv_position_bytes(cfg, tensor, layers=cfg.num_layers - linear)
    return slots + standby + rows * (row_states + cfg.vocab_size * 4)


def sampler_weight_parts(job: Any, state: Any, mesh: Any, rmesh: Any) -> tuple[dict[str, int], dict[str, int]]:
    """(train, rollout) bytes per device of the sampler's weights, from the shapes of the model's whole state as the
    job trains it: the copy the sampler decodes with ("sampler_params", in rollout.param_dtype), with merged LoRA the
    frozen base the adapters are folded into at each hand-off ("lora_base"), and the next version's copy
    ("handoff"), which exists beside the current one from a publish until the sampler swaps at its next dispatch
    boundary. A plain model's update writes that copy itself (`trainer.publish`), on the train devices: with the
    slices apart it is counted there too (with them shared, once, in the rollout's layout). With LoRA only the
    adapters cross; the merged form folds them into a fresh copy on the rollout devices."""
    dtype = None if job.rollout.param_dtype == "same" else jnp.dtype(job.rollout.param_dtype)

    def on(tree: Any, where: Any, cast: bool = True) -> int:
        tree = cast_shapes(tree, dtype) if cast else tree
        return per_device_bytes(tree, logical_to_mesh_sharding(tree, where))

    if not job.lora.enabled:
        weights = on(state, rmesh)
        return {"handoff": on(state, mesh)}, {"sampler_params": weights, "handoff": weights}
    from areal_jax.models import lora
    from areal_jax.system.lora_channel import split_adapters

    adapters, base = split_adapters(state)
    moved, kept = on(adapters, rmesh, cast=False), on(base, rmesh, cast=False)
    if job.lora.sampler == "unmerged":
        return {}, {"sampler_params": kept + moved, "handoff": moved}
    merged = jax.eval_shape(lambda b, a: lora.merge_state(nnx.merge_state(b, a), job.lora.scale, dtype), base, adapters)
    weights = on(merged, rmesh, cast=False)
    return {}, {"sampler_params": weights, "lora_base": kept, "handoff": weights + moved}
