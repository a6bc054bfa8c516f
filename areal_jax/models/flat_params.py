"""FlatParams: a model's parameter tree held as its flat leaves plus the tree structure.

Passing an ``nnx.State`` to a jitted function flattens it on every call, and each of its Variables is
flattened by a Python callback: at a few hundred leaves (290 for a 24-layer Qwen2) that is about 0.8 ms
of host time per dispatch, and rebuilding the State from leaves costs about 2 ms. The sampler
dispatches many small programs (k decode steps, prefills, inserts) and receives a new copy of the
weights after every update, so it holds its weights as a :class:`FlatParams` instead: a pytree node
whose children are the leaves (flattened by JAX's C++ code) and whose static part is the State's
treedef. Inside a traced function :func:`as_tree` rebuilds the State from tracers, at trace time only.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Cast every floating-point leaf of `tree` to `dtype` (None: unchanged); traced inside jit, so the
    cast runs on the device that holds the leaf. Other leaves (ints, bools) pass through."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def cast_leaves(tree: Any, dtype: Any) -> list[Any]:
    """The leaves of `tree`, floating ones cast to `dtype`, every leaf a fresh buffer (traced inside jit), as a
    flat list (a list output unflattens in C++; an nnx.State output would cost about a millisecond of Python per
    call): the sampler's copy, written by the update's last optimizer step or by the hand-off's channel."""
    return [jnp.copy(x) for x in jax.tree.leaves(cast_floating(tree, dtype))]


def cast_shapes(tree: Any, dtype: Any) -> Any:
    """`tree`'s shapes (arrays or ShapeDtypeStructs) with the floating ones in `dtype` (None: unchanged)."""
    return jax.eval_shape(lambda t: cast_floating(t, dtype), tree)


@jax.tree_util.register_pytree_node_class
class FlatParams:
    """The leaves of a parameter tree and its treedef; a pytree with the same leaves, in the same order."""

    __slots__ = ("leaves", "treedef", "_avals", "_shardings")

    def __init__(self, leaves: Sequence[Any], treedef: Any) -> None:
        self.leaves = tuple(leaves)
        self.treedef = treedef
        self._avals: tuple | None = None
        self._shardings: tuple | None = None
        if treedef.num_leaves != len(self.leaves):
            raise ValueError(f"FlatParams got {len(self.leaves)} leaves for a tree of {treedef.num_leaves}.")

    @property
    def avals(self) -> tuple[tuple[tuple[int, ...], Any], ...]:
        """(shape, dtype) of every leaf, read once: the leaves of a FlatParams never change, and a hand-off checks
        them more than once (the channel's plan, the sampler's layout check)."""
        if self._avals is None:
            self._avals = tuple((x.shape, x.dtype) for x in self.leaves)
        return self._avals

    @property
    def shardings(self) -> tuple[Any, ...]:
        """The sharding of every leaf (None for a leaf without one), read once."""
        if self._shardings is None:
            self._shardings = tuple(getattr(x, "sharding", None) for x in self.leaves)
        return self._shardings

    @classmethod
    def of(cls, tree: Any) -> "FlatParams":
        """``tree`` (an nnx.State or any pytree) flattened once; a FlatParams is returned as it is."""
        if isinstance(tree, FlatParams):
            return tree
        leaves, treedef = jax.tree.flatten(tree)
        return cls(leaves, treedef)

    def tree(self) -> Any:
        """The parameter tree (e.g. the nnx.State) these leaves came from."""
        return self.treedef.unflatten(self.leaves)

    def replace_leaves(self, leaves: Sequence[Any]) -> "FlatParams":
        """The same structure over other leaves (e.g. copies on another device)."""
        return FlatParams(leaves, self.treedef)

    def laid_out(self, shardings: Sequence[Any]) -> "FlatParams":
        """The same params with leaf i laid out by shardings[i]: leaves already so stay as they are, the
        others move in one device_put."""
        move = [i for i, (x, s) in enumerate(zip(self.shardings, shardings)) if x != s]
        if not move:
            return self
        leaves = list(self.leaves)
        for i, x in zip(move, jax.device_put([leaves[i] for i in move], [shardings[i] for i in move])):
            leaves[i] = x
        return self.replace_leaves(leaves)

    def tree_flatten(self) -> tuple[tuple[Any, ...], Any]:
        return self.leaves, self.treedef

    @classmethod
    def tree_unflatten(cls, treedef: Any, leaves: Sequence[Any]) -> "FlatParams":
        return cls(leaves, treedef)

    def __repr__(self) -> str:
        return f"FlatParams({len(self.leaves)} leaves)"


def merge_order(first: Any, second: Any) -> tuple[Any, list[int]]:
    """(treedef, order) of ``nnx.merge_state(first, second)``, found once from the two states' structures:
    leaf i of the merged tree is ``(leaves(first) + leaves(second))[order[i]]``, so a merge of arrays of the same
    structures is a reordering of their flat leaves, with no pass over an nnx.State."""
    from flax import nnx

    n, m = len(jax.tree.leaves(first)), len(jax.tree.leaves(second))
    if not m:
        return jax.tree.structure(first), list(range(n))
    merged = jax.tree.structure(nnx.merge_state(first, second))
    index_a = jax.tree.unflatten(jax.tree.structure(first), range(n))
    index_b = jax.tree.unflatten(jax.tree.structure(second), range(n, n + m))
    order = jax.tree.leaves(nnx.merge_state(index_a, index_b))
    if sorted(order) != list(range(n + m)) or merged.num_leaves != n + m:
        raise AssertionError("merging the two states lost or repeated a leaf")
    return merged, order


def merged_flat(first: Sequence[Any], second: Sequence[Any], treedef: Any, order: Sequence[int]) -> FlatParams:
    """The merge of two states held flat, from their leaves and `merge_order`'s (treedef, order)."""
    leaves = list(first) + list(second)
    return FlatParams([leaves[i] for i in order], treedef)


def as_tree(params: Any) -> Any:
    """The parameter tree of ``params``: rebuilt from a FlatParams, anything else unchanged."""
    return params.tree() if isinstance(params, FlatParams) else params


def check_same_layout(current: Any, new: Any, what: str = "update_params") -> None:
    """Raise ValueError naming the first leaf whose structure, shape or dtype differs between two
    parameter trees (nnx.State or FlatParams, in any mix)."""
    cur, got = FlatParams.of(current), FlatParams.of(new)
    if cur.treedef != got.treedef:
        raise ValueError(f"{what} got params with a different tree structure than the sampler's model; publish "
                         "the nnx.State of the same architecture (nnx.split(model)[1]).")
    if cur.avals == got.avals:
        return
    for i, ((a_shape, a_dtype), (b_shape, b_dtype)) in enumerate(zip(cur.avals, got.avals)):
        if a_shape != b_shape or a_dtype != b_dtype:
            path = jax.tree_util.tree_flatten_with_path(cur.tree())[0][i][0]
            raise ValueError(f"{what}: {jax.tree_util.keystr(path)} has shape {b_shape} {b_dtype}, the sampler's "
                             f"model has {a_shape} {a_dtype}; publish params of the same model configuration.")
