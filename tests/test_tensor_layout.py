"""The weight table of every architecture (`hf_names.weight_entries`, built from its family's `tensor_layout.Layout`
and renames): each parameter maps to HF tensors exactly once, and the parts of each fused or stacked HF tensor tile
it without gaps or overlaps."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import hf_names
from areal_jax.models.base_families import BASE
from areal_jax.models.families import OWN_MODULES
from areal_jax.models.tensor_layout import LLAMA, Layout, block_sparse_moe
from areal_jax.models.transformer import Transformer
from areal_jax.testing.tiny_configs import tiny_config

ARCHS = sorted(set(BASE) | {a for m in OWN_MODULES for a in m.HF_CLASSES})


def _param_shapes(cfg) -> dict[tuple, tuple[int, ...]]:
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(abstract, nnx.Param))[0]
    return {tuple(k.key for k in kp if isinstance(k, jax.tree_util.DictKey)): tuple(leaf.shape) for kp, leaf in leaves}


def _check_tiling(name: str, group: list, shapes: dict) -> None:
    """The parts of one HF tensor cover it exactly once (rows, interleaved columns, gathered channels or experts)."""
    whole = {e.fused_shape(shapes[e.path]) for e in group}
    assert len(whole) == 1, f"{name}: its parts imply different shapes {whole}"
    for e in group:  # a part's channels regrouped: a permutation of its own rows
        if e.channels is not None and e.gather is None:
            own = e.hf_shape(shapes[e.path])[0]
            assert sorted(e.channels) == list(range(own)), f"{name}: channels are no permutation of {own} rows"
    if len(group) == 1 and group[0].rows is None and group[0].gather is None:
        return
    if group[0].gather is not None:
        taken = np.concatenate([np.asarray(e.channels) for e in group])
        assert sorted(taken.tolist()) == list(range(group[0].gather)), f"{name}: channels do not partition it"
    elif group[0].interleave is not None:
        assert sorted(e.interleave for e in group) == [(j, len(group)) for j in range(len(group))], name
    elif group[0].rows is not None:
        spans = [e.rows for e in group]
        assert spans[0][0] == 0 and spans[-1][1] == spans[-1][2], f"{name}: rows {spans} leave an end uncovered"
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), f"{name}: rows {spans} leave a gap or overlap"
    else:
        raise AssertionError(f"{name}: {len(group)} parameters share it without saying how")


@pytest.mark.parametrize("arch", ARCHS)
def test_every_parameter_is_one_hf_tensor_or_an_exact_part_of_one(arch):
    cfg = tiny_config(arch)
    shapes = _param_shapes(cfg)
    entries = hf_names.weight_entries(cfg)
    by_path: dict[tuple, list] = {}
    by_name: dict[str, list] = {}
    for e in entries:
        by_path.setdefault(e.path, []).append(e)
        by_name.setdefault(e.hf_name, []).append(e)
    assert set(by_path) == set(shapes), (set(by_path) ^ set(shapes))
    for path, group in by_path.items():
        experts = [e.expert for e in group]
        assert experts == [None] or sorted(experts) == list(range(shapes[path][0])), (path, experts)
    for name, group in by_name.items():
        if group[0].expert is None:
            _check_tiling(name, group, shapes)
        else:  # one expert's slice of one stacked parameter
            assert len(group) == 1, (name, [e.path for e in group])
    assert all(n.startswith(("model.", "lm_head.", "gpt_neox.", "embed_out.", "backbone.", "transformer."))
               for n in by_name), sorted(by_name)[:5]


def test_each_declared_layout_names_an_architecture_of_its_module():
    for m in OWN_MODULES:
        assert set(getattr(m, "LAYOUTS", {})) <= set(m.HF_CLASSES), m.__name__
    declared = {a for m in OWN_MODULES for a in getattr(m, "LAYOUTS", {})} | {a for a, r in BASE.items()
                                                                              if r.layout != LLAMA}
    assert {a for a in ARCHS if hf_names.layout_of(a) != LLAMA} == declared
    assert hf_names.layout_of("llama") == LLAMA and hf_names.layout_of("phi3") == Layout(qkv="fused", gate_up="fused")


def test_an_unknown_layout_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"Layout.experts='packed': choose one of \('apart', 'stacked'"):
        Layout(experts="packed")


def test_mixtral_names_worked_by_hand():
    assert block_sparse_moe("model.layers.3.mlp.experts.7.gate_proj.weight") == \
        "model.layers.3.block_sparse_moe.experts.7.w1.weight"
    assert block_sparse_moe("model.layers.3.mlp.experts.7.up_proj.weight") == \
        "model.layers.3.block_sparse_moe.experts.7.w3.weight"
    assert block_sparse_moe("model.layers.3.mlp.experts.7.down_proj.weight") == \
        "model.layers.3.block_sparse_moe.experts.7.w2.weight"
    assert block_sparse_moe("model.layers.3.mlp.gate.weight") == "model.layers.3.block_sparse_moe.gate.weight"
    assert block_sparse_moe("model.layers.3.mlp.e_score_correction_bias") == \
        "model.layers.3.block_sparse_moe.e_score_correction_bias"
    assert block_sparse_moe("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"
