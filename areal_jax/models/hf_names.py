"""The table between a model's parameters and an HF checkpoint's tensors (`weight_entries`): which tensor each
parameter is, and the exact transposes and reshapes between the layouts (HF linear weights are [out, in]; ours
[in, ...out]: q_proj [D, H, Dh], o_proj [H, Dh, D], gate/up [D, F], down [F, D], lm_head [D, V], a layer's experts
stacked [E, ...]). The table is built from the family's `tensor_layout.Layout` (which tensors its checkpoints fuse or
stack) under Llama's names (Qwen3-MoE's for experts), then renamed by the family's `hf_name`. models.hf_io reads and
writes checkpoints with it."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from areal_jax.models.base_families import BASE
from areal_jax.models.config import ModelConfig
from areal_jax.models.families import OWN_MODULES
from areal_jax.models.tensor_layout import LLAMA, Layout


@dataclass(frozen=True)
class _Entry:
    """One parameter: our state path, its HF tensor name and the layout conversion.

    kind "same": identical layout; "flat": ours [N, Dh] <-> HF [N * Dh];
    "in_first": ours [D_in, *out] <-> HF [prod(out), D_in]; "out_last": ours [*in, D_out] <-> HF [D_out, prod(in)];
    "swap_last": ours [E, a, b] <-> HF [E, b, a] (Granite's stacked experts); "row": ours [N] <-> HF [1, N];
    "conv": ours [K, C] <-> HF [C, 1, K] (a depthwise convolution's taps: Gated DeltaNet's conv1d).
    rows: (start, stop, total) when the HF tensor fuses several of ours along its first axis (Phi's qkv_proj and
    gate_up_proj; for "swap_last", its second: Granite's input_linear): ours is its rows start..stop of total.
    expert: the HF tensor is this expert's slice of ours (ours stacks a layer's experts on its first axis; HF
    keeps one tensor per expert); shapes given to the methods are then ours whole, and `to_ours` / `to_hf` take
    and return the one expert's slice.
    interleave: (offset, count) when the HF tensor interleaves `count` of ours along its last axis (gpt-oss's
    gate_up_proj: gate at even columns, up at odd ones): ours is its columns offset::count ("same" kind).
    channels: ours takes the HF tensor's first-axis entries in this order (Gated DeltaNet's, grouped by key head).
    gather: with channels, the HF tensor fuses several of ours in an order of its own and has `gather` rows, ours
    being rows `channels` of it (Qwen3-Next's in_proj_qkvz and in_proj_ba, interleaved key head by key head).
    """

    path: tuple[str | int, ...]
    hf_name: str
    kind: str
    rows: tuple[int, int, int] | None = None
    expert: int | None = None
    interleave: tuple[int, int] | None = None
    channels: tuple[int, ...] | None = None
    gather: int | None = None

    @property
    def row_axis(self) -> int:
        """The HF tensor's axis that `rows` indexes."""
        return 1 if self.kind == "swap_last" else 0

    def fused_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole HF tensor's shape (the fused one where `rows` is set)."""
        own = self.hf_shape(shape)
        if self.gather is not None:
            return (self.gather,) + own[1:]
        if self.interleave is not None:
            return own[:-1] + (own[-1] * self.interleave[1],)
        if self.rows is None:
            return own
        a = self.row_axis
        return own[:a] + (self.rows[2],) + own[a + 1:]

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.expert is not None:
            shape = shape[1:]
        if self.kind == "same":
            return shape
        if self.kind == "flat":
            return (int(np.prod(shape)),)
        if self.kind == "in_first":
            return (int(np.prod(shape[1:])), shape[0])
        if self.kind == "swap_last":
            return (shape[0], shape[2], shape[1])
        if self.kind == "row":
            return (1, *shape)
        if self.kind == "conv":
            return (shape[1], 1, shape[0])
        return (shape[-1], int(np.prod(shape[:-1])))

    def to_ours(self, hf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        if self.expert is not None:
            shape = shape[1:]
        if self.interleave is not None:
            hf = hf[..., self.interleave[0]::self.interleave[1]]
        if self.channels is not None:
            hf = hf[np.asarray(self.channels)]
        if self.kind in ("same", "flat", "row"):
            return hf.reshape(shape)
        if self.kind == "swap_last":
            return hf.transpose(0, 2, 1).reshape(shape)
        if self.kind == "conv":
            return hf.reshape(shape[1], shape[0]).T
        return hf.T.reshape(shape)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        """Ours in HF's layout: the whole tensor, or with `rows`, `interleave` or `gather` this entry's part of a fused
        one (with gather, its rows in `channels`' order: models.hf_io puts each at its place)."""
        if self.gather is not None:
            return replace(self, channels=None, gather=None).to_hf(ours)
        if self.channels is not None:
            out = replace(self, channels=None).to_hf(ours)  # then each row back to its HF place
            hf = np.empty_like(out)
            hf[np.asarray(self.channels)] = out
            return hf
        if self.kind == "same":
            return ours
        if self.kind == "flat":
            return ours.reshape(-1)
        if self.kind == "row":
            return ours[None]
        if self.kind == "swap_last":
            return ours.transpose(0, 2, 1)
        if self.kind == "conv":
            return np.ascontiguousarray(ours.T[:, None, :])
        if self.kind == "in_first":
            return ours.reshape(ours.shape[0], -1).T
        return ours.reshape(-1, ours.shape[-1]).T


def weight_entries(cfg: ModelConfig) -> list[_Entry]:
    """The parameter <-> HF tensor table for `cfg`, in HF order (the parts of a fused tensor in its row order)."""
    entries = [_Entry(("embedding",), "model.embed_tokens.weight", "same")]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layout = layout_of(cfg.architecture)
    for i in range(cfg.num_layers):
        p, hf = ("layers", i), f"model.layers.{i}"
        linear = cfg.layer_is_linear(i)  # Gated DeltaNet in place of attention (Qwen3.5)
        olmo = cfg.olmo and not linear  # (OLMo Hybrid's Gated DeltaNet layers are pre-norm)
        if not olmo:
            entries.extend(_norm_entries(cfg, p + ("input_norm",), f"{hf}.input_layernorm"))
        if linear and cfg.short_conv is not None:
            entries.extend(_conv_entries(cfg, p + ("linear_attn",), f"{hf}.conv"))
        elif linear and cfg.mamba1 is not None:
            entries.extend(_mamba1_entries(cfg, p + ("linear_attn",), f"{hf}.mamba"))  # (Jamba's renamed below)
        elif (linear or cfg.layer_is_hybrid(i)) and cfg.mamba is not None:
            entries.extend(_mamba_entries(cfg, p + ("linear_attn",), f"{hf}.mamba"))  # (Bamba's renamed below)
        elif linear:
            entries.extend(_linear_entries(cfg, p + ("linear_attn",), f"{hf}.linear_attn", layout.linear))
        if layout.qkv == "per_head" and not linear:  # one query_key_value: per head its q, k and v rows side by side
            entries.extend(_neox_qkv_entries(cfg, p + ("attn",), f"{hf}.self_attn.query_key_value"))
        for name, rows in zip("qkv" if cfg.mla is None and not linear and layout.qkv != "per_head" else "",
                              ((0, q), (q, q + kv), (q + kv, q + 2 * kv))):
            if layout.qkv == "fused":
                entries.append(_Entry(p + ("attn", f"{name}_proj"), f"{hf}.self_attn.qkv_proj.weight", "in_first",
                                      (*rows, q + 2 * kv)))
                continue
            entries.append(_Entry(p + ("attn", f"{name}_proj"), f"{hf}.self_attn.{name}_proj.weight", "in_first"))
            if cfg.attention_bias:
                entries.append(_Entry(p + ("attn", f"{name}_bias"), f"{hf}.self_attn.{name}_proj.bias", "flat"))
        if cfg.mla is not None:
            entries.extend(_latent_entries(cfg, p + ("attn",), f"{hf}.self_attn"))
        if not linear:
            entries.append(_Entry(p + ("attn", "o_proj"), f"{hf}.self_attn.o_proj.weight", "out_last"))
        if cfg.head_gate and not linear:  # LFM3's per-head output gate
            entries.append(_Entry(p + ("attn", "g_proj"), f"{hf}.self_attn.g_proj.weight", "in_first"))
        if cfg.qk_norm and not linear and not cfg.weightless_norms:
            for norm in ("q_norm", "k_norm"):
                entries.append(_Entry(p + ("attn", norm, "scale"), f"{hf}.self_attn.{norm}.weight", "same"))
        if cfg.layer_has_mlp(i):  # (else the token mixer alone: Nemotron-H)
            entries.extend(_ffn_entries(cfg, p, hf, olmo, layout))
        if cfg.attention_out_bias:
            entries.append(_Entry(p + ("attn", "o_bias"), f"{hf}.self_attn.o_proj.bias", "same"))
        if cfg.attention_sinks:
            entries.append(_Entry(p + ("attn", "sinks"), f"{hf}.self_attn.sinks", "same"))
    entries.extend(_norm_entries(cfg, ("final_norm",), "model.norm"))
    if not cfg.tie_word_embeddings:
        entries.append(_Entry(("lm_head",), "lm_head.weight", "in_first"))
    if cfg.lm_head_bias:
        entries.append(_Entry(("lm_head_bias",), "lm_head.bias", "same"))
    rename = _RENAMES.get(cfg.architecture)  # the same tensors under the family's own names (Bamba's, Mamba's, ...)
    return entries if rename is None else [replace(e, hf_name=rename(e.hf_name, cfg)) for e in entries]


# the families whose checkpoints name tensors otherwise than Llama's: their modules' hf_name(name, cfg), their rows'
_RENAMES = {**{arch: (lambda name, cfg, f=row.hf_name: f(name)) for arch, row in BASE.items() if row.hf_name},
            **{arch: m.hf_name for m in OWN_MODULES if hasattr(m, "hf_name") for arch in m.HF_CLASSES}}
_LAYOUTS = {**{arch: row.layout for arch, row in BASE.items()},
            **{arch: layout for m in OWN_MODULES for arch, layout in getattr(m, "LAYOUTS", {}).items()}}


def layout_of(architecture: str) -> Layout:
    """How `architecture`'s checkpoints store fused or stacked tensors (Llama's layout unless its family says)."""
    return _LAYOUTS.get(architecture, LLAMA)


def _ffn_entries(cfg: ModelConfig, p: tuple[str | int, ...], hf: str, olmo: bool, layout: Layout) -> list[_Entry]:
    """Layer p's feed-forward and the norms about it: a dense MLP (gate and up apart or fused in one gate_up_proj; no
    gate in Arcee's), or experts (`_expert_entries`)."""
    i, f = p[1], cfg.intermediate_size
    post_attn, pre_ffn, post_ffn = "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"
    one = cfg.parallel_block and not cfg.parallel_mlp_norm  # (Cohere's: one norm before attention and the MLP)
    entries = [] if one else _norm_entries(cfg, p + ("post_attn_norm",), f"{hf}.{post_attn}")
    if cfg.sandwich_norms:
        entries.append(_Entry(p + ("pre_ffn_norm", "scale"), f"{hf}.{pre_ffn}.weight", "same"))
    if cfg.sandwich_norms or olmo:
        entries.append(_Entry(p + ("post_ffn_norm", "scale"), f"{hf}.{post_ffn}.weight", "same"))
    if cfg.layer_is_moe(i):
        return entries + _expert_entries(cfg, p + ("mlp",), hf, layout)
    if layout.gate_up == "fused":
        up = f"{hf}.mlp.gate_up_proj.weight"
        entries.append(_Entry(p + ("mlp", "gate_proj"), up, "in_first", (0, f, 2 * f)))
        entries.append(_Entry(p + ("mlp", "up_proj"), up, "in_first", (f, 2 * f, 2 * f)))
    else:
        if cfg.gated_mlp:
            entries.append(_Entry(p + ("mlp", "gate_proj"), f"{hf}.mlp.gate_proj.weight", "in_first"))
        entries.append(_Entry(p + ("mlp", "up_proj"), f"{hf}.mlp.up_proj.weight", "in_first"))
    down = f"{hf}.mlp.down_proj"
    if cfg.mlp_activation == "xielu":  # (Apertus' activation scalars)
        entries += [_Entry(p + ("mlp", f"xielu_{n}"), f"{hf}.mlp.act_fn.{n}", "same")
                    for n in ("alpha_p", "alpha_n", "beta", "eps")]
    if cfg.mlp_bias:  # (StarCoder2's)
        entries += [_Entry(p + ("mlp", f"{part}_bias"), f"{hf}.mlp.{part}_proj.bias", "same")
                    for part in ("gate", "up", "down") if part != "gate" or cfg.gated_mlp]
    return entries + [_Entry(p + ("mlp", "down_proj"), f"{down}.weight", "out_last")]


def _neox_qkv_entries(cfg: ModelConfig, path: tuple[str | int, ...], hf: str) -> list[_Entry]:
    """GPT-NeoX's fused query_key_value (weights, then biases): head h's rows are its q, its k, its v, each head_dim."""
    h, hd = cfg.num_heads, cfg.head_dim
    rows = [tuple(int(r) for r in (np.arange(h)[:, None] * 3 * hd + j * hd + np.arange(hd)).reshape(-1)) for j in range(3)]
    out = [_Entry(path + (f"{n}_proj",), f"{hf}.weight", "in_first", channels=r, gather=3 * h * hd)
           for n, r in zip("qkv", rows)]
    return out + ([_Entry(path + (f"{n}_bias",), f"{hf}.bias", "flat", channels=r, gather=3 * h * hd)
                   for n, r in zip("qkv", rows)] if cfg.attention_bias else [])


def _norm_entries(cfg: ModelConfig, path: tuple[str | int, ...], hf: str) -> list[_Entry]:
    """A decoder-wide norm's scale (HF's weight), and its bias where the LayerNorms have one (PhiMoE); none where
    the norms have no scale (NanoChat)."""
    if cfg.weightless_norms:
        return []
    out = [_Entry(path + ("scale",), f"{hf}.weight", "same")]
    return out + [_Entry(path + ("bias",), f"{hf}.bias", "same")] if cfg.norm_bias else out


def _expert_entries(cfg: ModelConfig, path: tuple[str | int, ...], hf: str, layout: Layout) -> list[_Entry]:
    """A mixture-of-experts layer's router and experts as `layout.experts` stores them: "apart" as Qwen3-MoE's
    (mlp.gate, mlp.experts.{j}.{gate,up,down}_proj; a shared expert beside them: `_shared_entries`), "stacked" as
    Granite MoE's (block_sparse_moe.router.layer, input_linear [E, 2F, D]: gate rows then up rows, output_linear
    [E, D, F]; a shared MLP as shared_mlp.input_linear, gate and up fused, and output_linear), "interleaved" as
    gpt-oss' (mlp.router weight and bias, mlp.experts.gate_up_proj: gate at even columns, up at odd ones, down_proj,
    and their biases)."""
    if layout.experts == "interleaved":
        base = f"{hf}.mlp"
        return [_Entry(path + ("router",), f"{base}.router.weight", "in_first"),
                _Entry(path + ("router_bias",), f"{base}.router.bias", "same"),
                *(_Entry(path + (f"experts_{part}{suffix}",), f"{base}.experts.gate_up_proj{suffix}", "same",
                         interleave=(j, 2)) for suffix in ("", "_bias") for j, part in enumerate(("gate", "up"))),
                _Entry(path + ("experts_down",), f"{base}.experts.down_proj", "same"),
                _Entry(path + ("experts_down_bias",), f"{base}.experts.down_proj_bias", "same")]
    if layout.experts == "stacked":
        base, f = f"{hf}.block_sparse_moe", cfg.expert_size
        out = [_Entry(path + ("router",), f"{base}.router.layer.weight", "in_first"),
               _Entry(path + ("experts_gate",), f"{base}.input_linear.weight", "swap_last", (0, f, 2 * f)),
               _Entry(path + ("experts_up",), f"{base}.input_linear.weight", "swap_last", (f, 2 * f, 2 * f)),
               _Entry(path + ("experts_down",), f"{base}.output_linear.weight", "swap_last")]
        if cfg.shared_expert_size:
            shared, w, mlp = path + ("shared_expert",), cfg.shared_expert_size, f"{hf}.shared_mlp"
            out += [_Entry(shared + ("gate_proj",), f"{mlp}.input_linear.weight", "in_first", (0, w, 2 * w)),
                    _Entry(shared + ("up_proj",), f"{mlp}.input_linear.weight", "in_first", (w, 2 * w, 2 * w)),
                    _Entry(shared + ("down_proj",), f"{mlp}.output_linear.weight", "out_last")]
        return out
    base = f"{hf}.mlp"
    out = [_Entry(path + ("router",), f"{base}.gate.weight", "in_first")]
    for part in ("gate", "up", "down") if cfg.gated_mlp else ("up", "down"):
        kind = "out_last" if part == "down" else "in_first"
        out += [_Entry(path + (f"experts_{part}",), f"{base}.experts.{j}.{part}_proj.weight", kind, expert=j)
                for j in range(cfg.num_experts)]
    if cfg.router_score_bias and layout.score_bias == "statics":  # [1, E] in its moe_statics (ERNIE 4.5)
        out.append(_Entry(path + ("router_score_bias",), f"{base}.moe_statics.e_score_correction_bias", "row"))
    elif cfg.router_score_bias:  # DeepSeek-V3's picking bias (beside the gate: MiniMax-M2's, EXAONE MoE's)
        holder = base if layout.score_bias == "beside" else f"{base}.gate"
        out.append(_Entry(path + ("router_score_bias",), f"{holder}.e_score_correction_bias", "same"))
    return out + _shared_entries(cfg, path, base)


def _shared_entries(cfg: ModelConfig, path: tuple[str | int, ...], base: str) -> list[_Entry]:
    """Qwen2-MoE's shared expert and its sigmoid gate (Qwen3.5-MoE's too); DeepSeek's shared_experts, ungated."""
    if not cfg.shared_expert_size:
        return []
    shared, name = path + ("shared_expert",), "shared_expert" if cfg.shared_expert_gated else "shared_experts"
    out = [_Entry(shared + ("gate_proj",), f"{base}.{name}.gate_proj.weight", "in_first")] \
        if cfg.gated_mlp else []  # (Nemotron-H's: up and down)
    out += [_Entry(shared + ("up_proj",), f"{base}.{name}.up_proj.weight", "in_first"),
            _Entry(shared + ("down_proj",), f"{base}.{name}.down_proj.weight", "out_last")]
    if cfg.shared_expert_gated:
        out.append(_Entry(path + ("shared_expert_gate",), f"{base}.shared_expert_gate.weight", "in_first"))
    return out


def _latent_entries(cfg: ModelConfig, path: tuple[str | int, ...], hf: str) -> list[_Entry]:
    """Latent attention's projections and norms but o_proj (models.mla), as DeepSeek-V3 names them."""
    if cfg.mla.q_lora_rank is None:
        out = [_Entry(path + ("q_proj",), f"{hf}.q_proj.weight", "in_first")]
    else:
        out = [_Entry(path + ("q_a_proj",), f"{hf}.q_a_proj.weight", "in_first"),
               _Entry(path + ("q_a_norm", "scale"), f"{hf}.q_a_layernorm.weight", "same"),
               _Entry(path + ("q_b_proj",), f"{hf}.q_b_proj.weight", "in_first")]
    return out + [_Entry(path + ("kv_a_proj",), f"{hf}.kv_a_proj_with_mqa.weight", "in_first"),
                  _Entry(path + ("kv_a_norm", "scale"), f"{hf}.kv_a_layernorm.weight", "same"),
                  _Entry(path + ("kv_b_proj",), f"{hf}.kv_b_proj.weight", "in_first")]


def _linear_entries(cfg: ModelConfig, path: tuple[str | int, ...], hf: str, split: str) -> list[_Entry]:
    """A Gated DeltaNet layer's parameters (models.gated_deltanet), as Qwen3.5 names them under linear_attn (the
    channels of in_proj_qkv and conv1d regrouped by key head: `gated_deltanet.grouped_channels`), Qwen3-Next's with
    its fused in_proj_qkvz and in_proj_ba, or OLMo Hybrid's (`tensor_layout.Layout.linear`: `split`)."""
    from areal_jax.models.gated_deltanet import grouped_channels  # noqa: PLC0415 (it imports the layers)

    grouped = tuple(int(i) for i in grouped_channels(cfg))
    if split == "qkvz":  # q, k, v, z and b, a fused, key head by key head
        m = cfg.linear
        r = m.value_heads // m.key_heads
        qkv, z, block = 2 * m.key_dim + r * m.value_dim, r * m.value_dim, 2 * m.key_dim + 2 * r * m.value_dim

        def rows(width: int, offset: int, stride: int) -> tuple[int, ...]:
            return tuple(int(i) for i in (np.arange(m.key_heads)[:, None] * stride + offset + np.arange(width)).ravel())

        projections = [_Entry(path + ("in_proj_qkv",), f"{hf}.in_proj_qkvz.weight", "in_first",
                              channels=rows(qkv, 0, block), gather=m.key_heads * block),
                       _Entry(path + ("in_proj_z",), f"{hf}.in_proj_qkvz.weight", "in_first",
                              channels=rows(z, qkv, block), gather=m.key_heads * block),
                       _Entry(path + ("in_proj_b",), f"{hf}.in_proj_ba.weight", "in_first", channels=rows(r, 0, 2 * r),
                              gather=2 * m.value_heads),
                       _Entry(path + ("in_proj_a",), f"{hf}.in_proj_ba.weight", "in_first", channels=rows(r, r, 2 * r),
                              gather=2 * m.value_heads)]
    elif split == "named":  # q, k, v apart; z, a, b, out named g, a, b, o
        projections = [_Entry(path + (f"in_proj_{ours}",), f"{hf}.{theirs}_proj.weight", "in_first")
                       for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("z", "g"), ("b", "b"), ("a", "a"))]
        return [*projections, _Entry(path + ("conv",), f"{hf}.conv1d.weight", "conv", channels=grouped),
                _Entry(path + ("dt_bias",), f"{hf}.dt_bias", "same"), _Entry(path + ("A_log",), f"{hf}.A_log", "same"),
                _Entry(path + ("norm_scale",), f"{hf}.o_norm.weight", "same"),
                _Entry(path + ("out_proj",), f"{hf}.o_proj.weight", "out_last")]
    else:
        projections = [_Entry(path + ("in_proj_qkv",), f"{hf}.in_proj_qkv.weight", "in_first", channels=grouped),
                       _Entry(path + ("in_proj_z",), f"{hf}.in_proj_z.weight", "in_first"),
                       _Entry(path + ("in_proj_b",), f"{hf}.in_proj_b.weight", "in_first"),
                       _Entry(path + ("in_proj_a",), f"{hf}.in_proj_a.weight", "in_first")]
    return [*projections,
            _Entry(path + ("conv",), f"{hf}.conv1d.weight", "conv", channels=grouped),
            _Entry(path + ("dt_bias",), f"{hf}.dt_bias", "same"),
            _Entry(path + ("A_log",), f"{hf}.A_log", "same"),
            _Entry(path + ("norm_scale",), f"{hf}.norm.weight", "same"),
            _Entry(path + ("out_proj",), f"{hf}.out_proj.weight", "out_last")]


def _conv_entries(cfg: ModelConfig, path: tuple[str | int, ...], hf: str) -> list[_Entry]:
    """An LFM2 conv layer's parameters (models.short_conv): in_proj (its B, C and x regrouped channel by channel:
    `short_conv.interleaved_channels`), the convolution's taps and out_proj."""
    from areal_jax.models.short_conv import interleaved_channels  # noqa: PLC0415 (it imports the layers)

    grouped = tuple(int(i) for i in interleaved_channels(cfg.hidden_size))
    return [_Entry(path + ("in_proj",), f"{hf}.in_proj.weight", "in_first", channels=grouped),
            _Entry(path + ("conv",), f"{hf}.conv.weight", "conv"),
            _Entry(path + ("out_proj",), f"{hf}.out_proj.weight", "out_last")]


def _mamba1_entries(cfg: ModelConfig, path: tuple[str | int, ...], hf: str) -> list[_Entry]:
    """A Mamba mixer's parameters (models.mamba1): in_proj's rows x and z, x_proj's rows dt, B and C as ours apart."""
    m = cfg.mamba1
    i, r, n = m.inner, m.dt_rank, m.state
    norms = [_Entry(path + (ours,), f"{hf}.{theirs}.weight", "same")
             for ours, theirs in (("dt_norm", "dt_layernorm"), ("b_norm", "b_layernorm"), ("c_norm", "c_layernorm"))]
    return [_Entry(path + ("in_proj_x",), f"{hf}.in_proj.weight", "in_first", (0, i, 2 * i)),
            _Entry(path + ("in_proj_z",), f"{hf}.in_proj.weight", "in_first", (i, 2 * i, 2 * i)),
            _Entry(path + ("conv",), f"{hf}.conv1d.weight", "conv"),
            _Entry(path + ("conv_bias",), f"{hf}.conv1d.bias", "same"),
            _Entry(path + ("x_proj_dt",), f"{hf}.x_proj.weight", "in_first", (0, r, r + 2 * n)),
            _Entry(path + ("x_proj_b",), f"{hf}.x_proj.weight", "in_first", (r, r + n, r + 2 * n)),
            _Entry(path + ("x_proj_c",), f"{hf}.x_proj.weight", "in_first", (r + n, r + 2 * n, r + 2 * n)),
            _Entry(path + ("dt_proj",), f"{hf}.dt_proj.weight", "in_first"),
            _Entry(path + ("dt_bias",), f"{hf}.dt_proj.bias", "same"),
            *(_Entry(path + (name,), f"{hf}.{name}", "same") for name in ("A_log", "D")),
            *(norms if m.norms == "scaled" else []),
            _Entry(path + ("out_proj",), f"{hf}.out_proj.weight", "out_last")]


def _mamba_entries(cfg: ModelConfig, path: tuple[str | int, ...], hf: str) -> list[_Entry]:
    """A Mamba-2 mixer's parameters (models.mamba2): in_proj's rows z, x B C and dt as three of ours, the channels of x
    B C (and of the convolution) regrouped group by group (`mamba2.grouped_channels`)."""
    from areal_jax.models.mamba2 import grouped_channels  # noqa: PLC0415 (it imports the layers)

    m, grouped = cfg.mamba, tuple(int(i) for i in grouped_channels(cfg))
    inner = m.heads * m.head_dim
    ch = inner + 2 * m.groups * m.state
    total = inner + ch + m.heads
    return [_Entry(path + ("in_proj_z",), f"{hf}.in_proj.weight", "in_first", (0, inner, total)),
            _Entry(path + ("in_proj_xbc",), f"{hf}.in_proj.weight", "in_first", (inner, inner + ch, total),
                   channels=grouped),
            _Entry(path + ("in_proj_dt",), f"{hf}.in_proj.weight", "in_first", (inner + ch, total, total)),
            _Entry(path + ("conv",), f"{hf}.conv1d.weight", "conv", channels=grouped),
            _Entry(path + ("conv_bias",), f"{hf}.conv1d.bias", "same", channels=grouped),
            *(_Entry(path + (name,), f"{hf}.{name}", "same") for name in ("dt_bias", "A_log", "D")),
            *([] if m.norm is None else [_Entry(path + ("norm_scale",), f"{hf}.norm.weight", "same")]),
            _Entry(path + ("out_proj",), f"{hf}.out_proj.weight", "out_last")]
