"""Device memory of the sampler's own programs, read from XLA's buffer assignment before anything runs.

The sampler's resident memory (weights, KV cache, standby rows, decode logits) is counted from shapes by
`system.memory`. Its programs need working memory on top, while they run beside the trainer's update on a
colocated device: a decode dispatch (k steps: sampling over the vocabulary, each layer's attention over
the cache) and the longest prefill, which is a recompute of in-flight sequences up to max_len after a
weight update (rollout.on_update=recompute) or a preempted sample's resume, else the longest prompt. At
16,384 positions such a prefill scored 48 GiB of attention at once before `cache_attention.cached_attention` split
its queries into blocks; XLA reports what a program needs exactly (`memory_analysis().temp_size_in_bytes`).

As for the update (`trainer.memory`), the programs of a 3- and a 4-layer copy of the model are compiled
(abstract: nothing is allocated) and their difference extended to every layer. Shallower copies are not a
good base: XLA computes the last layer's MLP for the one position whose logits are kept, so a 1-layer
prefill skips the full-length MLP activations that every deeper program holds, and at the 1.5B shape the
2-to-3-layer step was half the per-layer growth from 3 layers on (XLA:CPU, 16,512-token prefill: 2.53, 2.59,
2.71, 2.84 GiB at 2-5 layers, 5.74 GiB at 28; extended from 3 and 4 layers, 5.74). The paged cache is
probed with a one-sequence pool (what a decode step reads depends on the page table, not on the pool's size).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.flat_params import cast_shapes
from areal_jax.models.sharding import logical_to_mesh_sharding
from areal_jax.sampler.sampling import SamplingFilters, SamplingParams

PROGRAMS = ("decode", "prefill")
BASE_LAYERS = 3  # probed at 3 and 4 layers (see the module docstring)


def longest_prefill(rollout: Any, max_prompt_len: int) -> int:
    """Tokens of the longest prefill the sampler runs: max_len when in-flight sequences are re-prefilled (a
    recompute after a weight update, or a preempted sample's resume over an optimistic page pool), else the
    longest prompt."""
    recompute = rollout.on_update == "recompute"
    preempts = rollout.kv_cache == "paged" and rollout.kv_admission == "optimistic"
    return int(rollout.max_len if recompute or preempts else min(rollout.max_len, max_prompt_len))


def probe_filters(rollout: Any) -> SamplingFilters:
    """The sampling transforms the rollout's decode program holds (its top-k / top-p), with the noise of sampled
    rows always (an evaluation stream samples beside its greedy rows)."""
    sampling = SamplingParams(temperature=max(float(rollout.temperature), 1.0), top_k=rollout.top_k,
                              top_p=rollout.top_p)
    return SamplingFilters.of(sampling)


def _probe_rollout(rollout: Any) -> Any:
    """The rollout config the probe builds its engine from: a one-sequence page pool for a paged cache."""
    if rollout.kv_cache != "paged":
        return rollout
    return dataclasses.replace(rollout, kv_pages=-(-rollout.max_len // rollout.page_size))


def program_temp_bytes(rollout: Any, model_cfg: ModelConfig, mesh: Any, *, layers: int, program: str,
                       longest: int, kind: str = "attention") -> int | None:
    """XLA's working memory (bytes per rollout device) of one sampler program for a `layers`-layer copy of the
    model: "decode", a dispatch of rollout.decode_steps steps over every slot; "prefill", the batched
    prefill-and-insert call at the bucket of `longest` tokens. None where the backend gives no memory
    analysis. One small compile. kind: the copy's layers, as in `trainer.memory.update_temp_bytes`."""
    from areal_jax.models import Transformer
    from areal_jax.trainer.memory import abstract, probe_config

    if program not in PROGRAMS:
        raise ValueError(f"program must be one of {PROGRAMS}, got {program!r}.")
    small = probe_config(model_cfg, layers, kind)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(small, rngs=nnx.Rngs(0))))
    if rollout.param_dtype != "same":
        params = cast_shapes(params, jnp.dtype(rollout.param_dtype))
    engine = _probe_rollout(rollout).make_engine(graphdef, mesh=mesh, config=small)
    if mesh is not None:
        params = abstract(params, logical_to_mesh_sharding(params, mesh))
    state = jax.eval_shape(engine._init_fn)
    if engine._state_sharding is not None:
        state = abstract(state, engine._state_sharding)
    if program == "decode":
        keys = jax.ShapeDtypeStruct((int(rollout.decode_steps), 2), jnp.uint32)
        compiled = engine._lower(engine._jit_generate_steps, params, state, keys, filters=probe_filters(rollout)).compile()
    else:
        bucket = engine.bucket_for(min(int(longest), engine.max_len))
        rows = engine.prefill_rows_for(bucket)
        one = engine.settings(SamplingParams())
        settings = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *np.shape(x)), np.asarray(x).dtype), one)
        ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        compiled = engine._lower(engine._jit_prefill_insert, params, state, ints(rows, bucket), ints(rows), ints(rows),
                                 settings).compile()
    analysis = compiled.memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def program_bytes(rollout: Any, model_cfg: ModelConfig, mesh: Any, program: str, *, longest: int) -> int | None:
    """XLA's working memory of the full-depth sampler `program`, from its 3- and 4-layer copies (the program
    itself when the model is that shallow; a hybrid model's kinds of layer apart: `trainer.memory.extended_by_kind`).
    None where the backend gives no memory analysis."""
    from areal_jax.trainer.memory import extended_by_kind

    return extended_by_kind(lambda layers, kind: program_temp_bytes(rollout, model_cfg, mesh, layers=layers,
                                                                    program=program, longest=longest, kind=kind),
                            model_cfg, BASE_LAYERS)


def sampler_bytes(rollout: Any, model_cfg: ModelConfig, mesh: Any, *, max_prompt_len: int) -> dict[str, int] | None:
    """{"decode": bytes, "prefill": bytes}: the working memory of a decode dispatch and of the longest prefill
    (`longest_prefill`) on one rollout device; they run one after the other on the sampler's thread, so the
    larger counts. None where the backend gives no memory analysis. Four small compiles."""
    longest = longest_prefill(rollout, max_prompt_len)
    out = {p: program_bytes(rollout, model_cfg, mesh, p, longest=longest) for p in PROGRAMS}
    return None if None in out.values() else out
