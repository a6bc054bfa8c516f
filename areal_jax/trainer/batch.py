"""Trajectories in, padding-free packed micro-steps out (host-side numpy).

Layout. A trajectory of L tokens enters the model as its first L - 1 tokens (the last token predicts
nothing we train on); position p of the segment is trained to predict token p + 1, so completion token
j (0-based within the completion, absolute index prompt_len + j) is scored at position
prompt_len + j - 1. Several trajectories share one row of a micro-batch (segment ids 1, 2, ...;
positions restart at 0; padding has segment id 0). Row lengths come from the series 2^k, 3 * 2^(k-1)
(16, 24, 32, 48, 64, 96, ...), from the shortest that holds the longest trajectory up to four times
it, with R rows per device a power of two or as many as the budget holds (`trainer.layout.row_counts`):
`trainer.layout.step_layout` picks the pair whose packing costs
least, its padded positions (attention's share of a position's cost growing with the row: attention within a
row costs row_length^2) plus a fixed cost per micro-step.
`rl.packing.balanced_microbatches` fills the rows, a multiple of F * R of them (F data-parallel
devices), balanced in tokens. A micro-step hands R rows to each fsdp device, with
R * row_length <= micro_batch_tokens. Shapes come from a small set, so a run compiles a handful of
programs however batches are composed.

Aggregation weights. The loss of a minibatch is sum_t weight_t * loss_t over its valid tokens, with
weight_t = rl.aggregation.token_weights of the minibatch's masks (one row per trajectory), computed
before packing: 1 / N (token-mean over N valid tokens), 1 / (S * n_s) (seq-mean-token-mean: S
sequences with a valid token, n_s valid tokens in token t's sequence) or 1 / S (seq-mean-token-sum).
It is the aggregation `rl.losses` applies (`rl.aggregation.aggregate`), whatever the packing.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np

from areal_jax.models.moe import moe_layer_count
from areal_jax.rl.advantages import gae
from areal_jax.rl.aggregation import token_weights
from areal_jax.rl.packing import balanced_microbatches
from areal_jax.rl.staleness import sample_staleness, staleness_mask
from areal_jax.trainer.layout import MICRO_STEP_OVERHEAD, ShapeBook, step_layout

STEP_FIELDS = (
    "tokens", "positions", "segment_ids", "targets", "mask", "behav_logp", "versions", "advantages",
    "weights", "seq_index", "comp_index",
)


@dataclasses.dataclass
class Trajectory:
    """One finished sample (host-side numpy).

    Attributes:
      tokens: int32 [L], prompt then completion.
      prompt_len: number of prompt tokens (>= 1).
      behav_logp: float32 [L - prompt_len], the sampler's log-prob of each completion token.
      versions: int32 [L - prompt_len], the policy version that produced each completion token.
      advantage: sequence-level advantage, broadcast to every completion token.
      token_advantages: float32 [L - prompt_len] per-token advantages (overrides `advantage`).
      reward: the scalar reward; with a critic (TrainerConfig.critic="value_head") the terminal reward
        of GAE, on the last valid completion token (otherwise reported only).
      loss_mask: [L - prompt_len] bool/float, completion tokens that enter the loss (None: all).
      routes: integers [L, L_moe, k] (mixture-of-experts models, train.router_replay; the sampler's are uint8 up to
        256 experts): the experts the sampler sent each token to in each expert layer (None: not recorded).
    """

    tokens: np.ndarray
    prompt_len: int
    behav_logp: np.ndarray
    versions: np.ndarray
    advantage: float = 0.0
    token_advantages: np.ndarray | None = None
    reward: float = 0.0
    loss_mask: np.ndarray | None = None
    routes: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, np.int32).reshape(-1)
        self.prompt_len = int(self.prompt_len)
        n = self.tokens.size - self.prompt_len
        if self.prompt_len < 1 or n < 1:
            raise ValueError(
                f"A trajectory needs at least one prompt token and one completion token; got "
                f"{self.tokens.size} tokens with prompt_len={self.prompt_len}."
            )
        self.behav_logp = np.asarray(self.behav_logp, np.float32).reshape(-1)
        self.versions = np.asarray(self.versions, np.int32).reshape(-1)
        named = {"behav_logp": self.behav_logp, "versions": self.versions}
        if self.token_advantages is not None:
            self.token_advantages = np.asarray(self.token_advantages, np.float32).reshape(-1)
            named["token_advantages"] = self.token_advantages
        if self.loss_mask is not None:
            self.loss_mask = np.asarray(self.loss_mask, np.float32).reshape(-1)
            named["loss_mask"] = self.loss_mask
        if self.routes is not None:
            self.routes = np.asarray(self.routes)
            if self.routes.ndim != 3 or self.routes.shape[0] != self.tokens.size:
                raise ValueError(f"Trajectory.routes has shape {self.routes.shape}; give [len(tokens)="
                                 f"{self.tokens.size}, expert layers, experts per token].")
            if not np.issubdtype(self.routes.dtype, np.integer):
                raise ValueError(f"Trajectory.routes must hold expert ids (integers), got dtype {self.routes.dtype}.")
        for name, arr in named.items():
            if arr.size != n:
                raise ValueError(
                    f"Trajectory.{name} has {arr.size} entries but the completion has {n} tokens "
                    f"(len(tokens)={self.tokens.size} - prompt_len={self.prompt_len}); give one per "
                    "completion token."
                )

    @property
    def completion_len(self) -> int:
        return self.tokens.size - self.prompt_len

    @property
    def packed_len(self) -> int:
        """Tokens this trajectory occupies in a packed row (L - 1)."""
        return self.tokens.size - 1

    def completion_advantages(self) -> np.ndarray:
        """float32 [L - prompt_len]."""
        if self.token_advantages is not None:
            return self.token_advantages
        return np.full(self.completion_len, self.advantage, np.float32)

    def completion_mask(self) -> np.ndarray:
        """float32 [L - prompt_len]: the loss mask before staleness filtering."""
        if self.loss_mask is not None:
            return (self.loss_mask != 0).astype(np.float32)
        return np.ones(self.completion_len, np.float32)


def _padded(arrays: Sequence[np.ndarray], fill, dtype) -> np.ndarray:
    """[N, W] with W the longest length rounded up to a power of two (at least 16): the staleness
    functions run eagerly here, and each new shape would lower and compile their programs again
    (a new maximum completion length nearly every update otherwise)."""
    width = max(16, 1 << (max(a.size for a in arrays) - 1).bit_length())
    out = np.full((len(arrays), width), fill, dtype)
    for i, a in enumerate(arrays):
        out[i, : a.size] = a
    return out


def effective_masks(
    trajs: Sequence[Trajectory], trainer_version: int, max_staleness: int | None
) -> tuple[list[np.ndarray], np.ndarray]:
    """Loss masks after staleness filtering, and each sample's staleness.

    Returns:
      masks: one float32 [L_i - prompt_len_i] per trajectory (rl.staleness.staleness_mask applied).
      staleness: int32 [N], trainer_version minus the oldest version among the sample's loss tokens
        (before filtering).
    """
    versions = _padded([t.versions for t in trajs], trainer_version, np.int32)
    mask = _padded([t.completion_mask() for t in trajs], 0.0, np.float32)
    filtered = np.asarray(staleness_mask(versions, trainer_version, max_staleness, mask))
    stale = np.asarray(sample_staleness(trainer_version, versions, mask)).astype(np.int32)
    return [filtered[i, : t.completion_len] for i, t in enumerate(trajs)], stale


def aggregation_weights(masks: Sequence[np.ndarray], agg: str) -> list[np.ndarray]:
    """Per-token loss weights of one minibatch: `rl.aggregation.token_weights` over its trajectories.

    masks: one float32 [L_i - prompt_len_i] effective loss mask per trajectory of the minibatch (a row
    each). Returns float32 arrays shaped like masks, 0 where masked (see the module docstring).
    """
    padded = _padded(masks, 0.0, np.float32)
    rows = max(1, 1 << (len(masks) - 1).bit_length())  # all-masked rows change no weight
    padded = np.pad(padded, ((0, rows - len(masks)), (0, 0)))
    weights = np.asarray(token_weights(padded, agg))
    return [weights[i, : m.size].astype(np.float32) for i, m in enumerate(masks)]


# Compiled once per padded shape and (gamma, lam): called eagerly, gae's scan would be traced and
# compiled again on every update (measured: 0.19 s per update on a 32 x 128-token batch, loaded CPU).
_gae_jit = jax.jit(gae, static_argnames=("gamma", "lam"))


def gae_targets(
    trajs: Sequence[Trajectory], masks: Sequence[np.ndarray], values: Sequence[np.ndarray], *, gamma: float,
    lam: float,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Critic targets: `rl.advantages.gae` over each trajectory's completion tokens.

    Each trajectory's reward is its terminal reward, placed on its last valid completion token (after
    staleness filtering, so a filtered tail does not lose it); masked tokens are skipped by gae.

    Args:
      trajs: the batch; masks: effective loss masks, float32 [L_i - prompt_len_i] each.
      values: float32 [L_i - prompt_len_i] each, V(s) at each completion token (the proximal forward).
    Returns: (advantages, returns), float32 [L_i - prompt_len_i] each, 0 at masked tokens.
    """
    rewards = []
    for t, m in zip(trajs, masks):
        r = np.zeros(t.completion_len, np.float32)
        valid = np.flatnonzero(m > 0)
        if valid.size:
            r[valid[-1]] = t.reward
        rewards.append(r)
    n = len(trajs)
    rows = max(1, 1 << (n - 1).bit_length())  # padded shapes: gae's scan compiles for few of them
    pad = lambda arrays: np.pad(_padded(arrays, 0.0, np.float32), ((0, rows - n), (0, 0)))  # noqa: E731
    adv, ret = _gae_jit(pad(rewards), pad(values), pad(masks), gamma=gamma, lam=lam)
    adv, ret = np.asarray(adv), np.asarray(ret)
    return ([adv[i, : t.completion_len].copy() for i, t in enumerate(trajs)],
            [ret[i, : t.completion_len].copy() for i, t in enumerate(trajs)])


def whiten(values: Sequence[np.ndarray], masks: Sequence[np.ndarray], eps: float = 1e-8) -> list[np.ndarray]:
    """Per-trajectory arrays shifted and scaled to mean 0, std 1 over every valid (mask > 0) token of the
    batch together (float64 statistics); masked tokens are 0. A batch with fewer than two valid tokens
    is only centred."""
    valid = np.concatenate([np.asarray(v, np.float64)[np.asarray(m) > 0] for v, m in zip(values, masks)] or
                           [np.zeros(0)])
    if valid.size == 0:
        return [np.zeros_like(np.asarray(v, np.float32)) for v in values]
    mean = valid.mean()
    scale = 1.0 / (valid.std() + eps) if valid.size > 1 else 1.0
    return [np.where(np.asarray(m) > 0, (np.asarray(v, np.float64) - mean) * scale, 0.0).astype(np.float32)
            for v, m in zip(values, masks)]


def fill_steps(step: dict[str, np.ndarray], name: str, per_traj: Sequence[np.ndarray]) -> None:
    """Lay per-trajectory completion values out in a packed step's layout, as step[name] (float32
    [rows, T]; 0 at masked and non-completion positions)."""
    out = np.zeros(step["mask"].shape, np.float32)
    sel = step["seq_index"] >= 0
    out[sel] = [per_traj[i][j] for i, j in zip(step["seq_index"][sel], step["comp_index"][sel])]
    step[name] = np.where(step["mask"] > 0, out, 0.0).astype(np.float32)


def split_minibatches(trajs: Sequence[Trajectory], n_minibatches: int) -> list[list[int]]:
    """Split trajectory indices into n_minibatches groups of about equal packed token count."""
    if len(trajs) < n_minibatches:
        raise ValueError(
            f"ppo_minibatches={n_minibatches} needs at least that many trajectories per update; got "
            f"{len(trajs)}. Lower ppo_minibatches or train on larger batches."
        )
    if n_minibatches == 1:
        return [list(range(len(trajs)))]
    lengths = [t.packed_len for t in trajs]
    # One budget that holds everything: exactly n_minibatches groups, balanced by token count.
    groups = balanced_microbatches(lengths, sum(lengths), n_minibatches)
    if not all(groups):  # cannot happen with >= n_minibatches positive lengths; keep every group non-empty
        groups = [list(range(i, len(trajs), n_minibatches)) for i in range(n_minibatches)]
    return groups


def pack_steps(
    trajs: Sequence[Trajectory],
    indices: Sequence[int],
    masks: Sequence[np.ndarray],
    weights: Sequence[np.ndarray] | None,
    *,
    n_devices: int,
    micro_batch_tokens: int,
    trainer_version: int,
    attention_weight: float = 0.0,
    step_overhead: int = MICRO_STEP_OVERHEAD,
    book: ShapeBook | None = None,
) -> list[dict[str, np.ndarray]]:
    """Pack the trajectories `indices` into micro-steps.

    Args:
      trajs: all trajectories of the batch.
      indices: the ones to pack (a minibatch).
      masks: per trajectory (indexed like trajs) float32 [L - prompt_len], the effective loss mask.
      weights: per trajectory aggregation weights like masks (None: zeros, for log-prob passes).
      n_devices: data-parallel devices (the train mesh's fsdp size).
      micro_batch_tokens: token budget of one device's share of a micro-step.
      trainer_version: fills `versions` at non-completion positions.
      attention_weight: attention's relative cost per position of row length (`layout.step_layout`).
      step_overhead: the fixed cost of one micro-step, in positions (`layout.step_layout`).
      book: the shapes compiled so far (`layout.ShapeBook`; None: the cheapest layout, whatever its shape).
    Returns:
      micro-steps: dicts of numpy [n_devices * R, T] arrays named in STEP_FIELDS (R rows per device;
      device d holds rows d*R .. d*R + R - 1) (int32: tokens, positions, segment_ids, targets,
      versions, seq_index (-1 off the completion), comp_index; float32: mask, behav_logp, advantages,
      weights). Every micro-step of a minibatch has the same shape.
    """
    lengths = [trajs[i].packed_len for i in indices]
    too_long = [(i, n) for i, n in zip(indices, lengths) if n > micro_batch_tokens]
    if too_long:
        i, n = too_long[0]
        raise ValueError(
            f"Trajectory {i} needs {n} packed tokens, more than micro_batch_tokens={micro_batch_tokens}; "
            "raise micro_batch_tokens to at least the longest prompt + completion."
        )
    row_len, per_device, groups = step_layout(lengths, n_devices, micro_batch_tokens, attention_weight, step_overhead,
                                              book)
    per_step = n_devices * per_device  # groups: rows sorted by decreasing token count
    steps = []
    for s in range(0, len(groups), per_step):
        chunk = groups[s : s + per_step]
        # Deal the step's rows round-robin so every device gets a similar token count.
        order = [chunk[i * n_devices + d] for d in range(n_devices) for i in range(per_device)]
        rows = [[indices[j] for j in g] for g in order]
        steps.append(_build_step(trajs, rows, masks, weights, row_len, trainer_version))
    return steps


def check_routes(trajs: Sequence[Trajectory], model_cfg, what: str) -> None:
    """Every trajectory carries routes of the model's shape [L, L_moe, k]; else a ValueError naming `what`
    (the setting that needs them)."""
    if model_cfg is None or not model_cfg.num_experts:
        raise ValueError(f"{what} needs a mixture-of-experts model; this one has no experts. Set it to off.")
    want = (moe_layer_count(model_cfg), model_cfg.num_experts_per_tok)
    for i, t in enumerate(trajs):
        if t.routes is None or t.routes.shape[1:] != want:
            got = None if t.routes is None else t.routes.shape
            raise ValueError(f"{what} needs each trajectory's routes [tokens, {want[0]}, {want[1]}] (the sampler "
                             f"records them when it is on); trajectory {i} has {got}.")
        if t.routes.size and (t.routes.min() < 0 or t.routes.max() >= model_cfg.num_experts):
            raise ValueError(f"trajectory {i}'s routes name experts outside 0..{model_cfg.num_experts - 1} "
                             f"({t.routes.min()}..{t.routes.max()}): they come from another model.")


def _build_step(trajs, rows, masks, weights, t_len: int, trainer_version: int) -> dict[str, np.ndarray]:
    n_rows = len(rows)
    first = next((trajs[i] for row in rows for i in row), None)
    routes = None
    if first is not None and first.routes is not None:  # the padding routes to expert 0 (masked out of everything)
        routes = np.zeros((n_rows, t_len, *first.routes.shape[1:]), np.int32)
    ints = {k: np.zeros((n_rows, t_len), np.int32) for k in ("tokens", "positions", "segment_ids", "targets")}
    ints["versions"] = np.full((n_rows, t_len), trainer_version, np.int32)
    ints["seq_index"] = np.full((n_rows, t_len), -1, np.int32)
    ints["comp_index"] = np.zeros((n_rows, t_len), np.int32)
    floats = {k: np.zeros((n_rows, t_len), np.float32) for k in ("mask", "behav_logp", "advantages", "weights")}
    for r, row in enumerate(rows):
        start = 0
        for seg, i in enumerate(row, start=1):
            t = trajs[i]
            n = t.packed_len
            span = slice(start, start + n)
            ints["tokens"][r, span] = t.tokens[:-1]
            ints["targets"][r, span] = t.tokens[1:]
            ints["positions"][r, span] = np.arange(n)
            ints["segment_ids"][r, span] = seg
            if routes is not None:
                routes[r, span] = t.routes[:-1]
            comp = slice(start + t.prompt_len - 1, start + n)  # positions scoring completion tokens
            ints["versions"][r, comp] = t.versions
            ints["seq_index"][r, comp] = i
            ints["comp_index"][r, comp] = np.arange(t.completion_len)
            m = masks[i]
            floats["mask"][r, comp] = m
            # Masked positions carry zeros, so non-finite values there cannot leak into the loss.
            floats["behav_logp"][r, comp] = np.where(m > 0, t.behav_logp, 0.0)
            floats["advantages"][r, comp] = np.where(m > 0, t.completion_advantages(), 0.0)
            if weights is not None:
                floats["weights"][r, comp] = weights[i]
            start += n
    return {**ints, **floats, **({} if routes is None else {"routes": routes})}


def staleness_stats(staleness: np.ndarray) -> dict[str, float]:
    """staleness_mean / staleness_max over samples (0 for an empty batch)."""
    if staleness.size == 0:
        return {"staleness_mean": 0.0, "staleness_max": 0.0}
    return {"staleness_mean": float(staleness.mean()), "staleness_max": float(staleness.max())}


def count_valid(masks: Sequence[np.ndarray], indices: Sequence[int]) -> tuple[int, int]:
    """(valid tokens, sequences with a valid token) among `indices`."""
    counts = [float(masks[i].sum()) for i in indices]
    return int(math.fsum(counts)), sum(c > 0 for c in counts)
