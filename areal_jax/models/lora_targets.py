"""What LoRA adapts (`LoRAConfig`, the config's `lora` section, and its targets): the projections' short names
(`PROJECTIONS`), their groups, which of a model's layers each applies to, and what the adapters weigh
(`adapter_bytes`). `models.lora` builds and runs the adapters."""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, ClassVar, Sequence

import jax.numpy as jnp

from areal_jax.knobs import ConfigError, Section, knob, require
from areal_jax.models.config import ModelConfig
from areal_jax.models.mixers import kind

PROJECTIONS = {  # short name -> (sub-module, attribute, number of input axes)
    "q": ("attn", "q_proj", 1), "k": ("attn", "k_proj", 1), "v": ("attn", "v_proj", 1), "o": ("attn", "o_proj", 2),
    "g": ("attn", "g_proj", 1),  # LFM3's per-head output gate (`ModelConfig.head_gate`)
    "gate": ("mlp", "gate_proj", 1), "up": ("mlp", "up_proj", 1), "down": ("mlp", "down_proj", 1),
    # latent attention's (models.mla)
    "q_a": ("attn", "q_a_proj", 1), "q_b": ("attn", "q_b_proj", 1), "kv_a": ("attn", "kv_a_proj", 1),
    "kv_b": ("attn", "kv_b_proj", 1),
    # a Gated DeltaNet layer's (models.gated_deltanet: Qwen3.5's linear attention), named also as HF does
    "in_qkv": ("linear_attn", "in_proj_qkv", 1), "in_z": ("linear_attn", "in_proj_z", 1),
    "in_b": ("linear_attn", "in_proj_b", 1), "in_a": ("linear_attn", "in_proj_a", 1),
    "out": ("linear_attn", "out_proj", 1),
    # an LFM2 conv layer's (models.short_conv; out_proj is "out" too)
    "in": ("linear_attn", "in_proj", 1),
    # OLMo Hybrid's Gated DeltaNet projects q, k, v apart (its z, b, a, out as Qwen3.5's)
    "in_q": ("linear_attn", "in_proj_q", 1), "in_k": ("linear_attn", "in_proj_k", 1),
    "in_v": ("linear_attn", "in_proj_v", 1),
    # a Mamba-2 mixer's in_proj parts (z is "in_z", out_proj "out")
    "in_xbc": ("linear_attn", "in_proj_xbc", 1), "in_dt": ("linear_attn", "in_proj_dt", 1),
    "in_x": ("linear_attn", "in_proj_x", 1),  # a Mamba mixer's x part of in_proj (Jamba's; its z is "in_z")
    # a mixture of experts' shared expert (models.moe.MoE.shared_expert, a dense MLP every token goes through:
    # Qwen2-MoE's, Qwen3.5-MoE's, DeepSeek's, Hunyuan MoE's)
    "shared_gate": ("mlp.shared_expert", "gate_proj", 1), "shared_up": ("mlp.shared_expert", "up_proj", 1),
    "shared_down": ("mlp.shared_expert", "down_proj", 1),
}
LINEAR = ("in_qkv", "in_z", "in_b", "in_a", "out")
CONV = ("in", "out")
SPLIT_LINEAR = ("in_q", "in_k", "in_v", "in_z", "in_b", "in_a", "out")  # OLMo Hybrid's Gated DeltaNet
MAMBA = ("in_z", "in_xbc", "in_dt", "out")  # Granite 4.0-H's, Bamba's Mamba-2 mixers
_MIXERS = LINEAR + ("in", "in_q", "in_k", "in_v", "in_xbc", "in_dt", "in_x")  # the stateful layers' projections, of any kind
_BY_ATTR = {attr: short for short, (part, attr, _) in PROJECTIONS.items() if part == "linear_attn"}
# a mixture-of-experts layer's stacked expert weights [E, in, out] (models.moe.MoE), adapted per expert
EXPERTS = ("experts_gate", "experts_up", "experts_down")
SHARED = ("shared_gate", "shared_up", "shared_down")
GROUPS = {"attn": ("q", "k", "v", "o", "g", "q_a", "q_b", "kv_a", "kv_b") + _MIXERS, "linear": _MIXERS,
          "mlp": ("gate", "up", "down"), "all": tuple(PROJECTIONS), "experts": EXPERTS, "shared": SHARED}
BASE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class LoRAConfig(Section):
    """Adapter settings (the config's `lora` section); `apply_lora` reads rank, alpha, dropout, targets and
    base_dtype, the job reads `enabled` and `sampler`."""

    section: ClassVar[str] = "lora"

    enabled: bool = knob(False, "train LoRA adapters on a frozen base; off: full fine-tuning")
    rank: int = knob(16, "r, the inner dimension of A and B (>= 1)")
    alpha: float = knob(32.0, "the update is (alpha / rank) * x @ A @ B")
    dropout: float = knob(0.0, "probability of zeroing an input of the adapter path while training, in [0, 1)")
    targets: str = knob("all", "q,k,v,o,gate,up,down (g: LFM3's head gate) | attn (Gated DeltaNet's and LFM2 conv layers' too) | linear "
                        "(Gated DeltaNet's: in_qkv,in_z,in_b,in_a,out, OLMo Hybrid's in_q,in_k,in_v,in_z,in_b,in_a,out; "
                        "LFM2 conv layers': in,out; Mamba-2's: in_z,in_xbc,in_dt,out; Mamba's: in_x,in_z,out) | mlp | shared (a mixture of experts' shared expert: shared_gate,"
                        "shared_up,shared_down) | all | experts (a mixture of experts' expert weights, not in all) | "
                        "re:<regex over 'layers.0.attn.q_proj'> (comma-separated)")
    base_dtype: str = knob("", "frozen base storage: '' (model.param_dtype) | float32 | bfloat16",
                           choices=("", *BASE_DTYPES))
    sampler: str = knob("merged", "merged (adapters folded into the sampler's copy at hand-off) | unmerged",
                        choices=("merged", "unmerged"))

    def check(self) -> None:
        require(self.rank >= 1, f"{self.key('rank')}={self.rank!r} must be a positive integer.")
        require(self.alpha > 0, f"{self.key('alpha')}={self.alpha!r} must be positive.")
        require(0.0 <= self.dropout < 1.0, f"{self.key('dropout')}={self.dropout!r} must lie in [0, 1).")
        try:
            names, _ = self.target_rules()
        except ValueError as err:  # each message starts with the key: "lora.targets entry ..."
            raise ConfigError(f"--config.{err}") from None
        require(not (self.dropout > 0 and names & set(EXPERTS)),
                f"{self.key('dropout')}={self.dropout} applies to projections only: the experts' adapters are folded "
                f"into their weights in each forward (no per-token input to drop); set {self.key('dropout')}=0 or "
                f"leave 'experts' out of {self.key('targets')}.")

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    def target_rules(self) -> tuple[set[str], list[re.Pattern]]:
        """(short projection names, compiled path patterns) named by `targets`."""
        names, patterns = set(), []
        entries = [e.strip() for e in str(self.targets).split(",") if e.strip()]
        if not entries:
            raise ValueError("lora.targets is empty; name projections, e.g. 'q,v', 'attn', 'all' or 're:layers\\.0\\..*'.")
        for entry in entries:
            if entry.startswith("re:"):
                try:
                    patterns.append(re.compile(entry[3:]))
                except re.error as err:
                    raise ValueError(f"lora.targets entry {entry!r} is not a valid regular expression: {err}.") from err
            elif entry in GROUPS:
                names.update(GROUPS[entry])
            elif entry.removesuffix("_proj") in PROJECTIONS:
                names.add(entry.removesuffix("_proj"))
            elif entry in _BY_ATTR:  # in_proj_qkv, out_proj, ...: HF's names
                names.add(_BY_ATTR[entry])
            elif entry in EXPERTS:
                names.add(entry)
            else:
                raise ValueError(f"lora.targets entry {entry!r} is unknown; use {', '.join(PROJECTIONS)}, "
                                 f"{', '.join(GROUPS)} or 're:<regex>' over paths like 'layers.0.attn.q_proj'.")
        return names, patterns

    def target_paths(self, num_layers: int, experts: Sequence[int] = (), attention: Sequence[str] = ("q", "k", "v", "o"),
                     mlp: Sequence[str] = ("gate", "up", "down"), linear: Sequence[int] = (),
                     shared: Sequence[int] = (), mixer: Sequence[str] = LINEAR,
                     hybrid: Sequence[int] = ()) -> list[tuple[int, str]]:
        """The (layer, short name) pairs adapted in a model of `num_layers` layers, in model order. experts: the
        layers whose feed-forward is a mixture of experts (`ModelConfig.layer_is_moe`): their gate / up / down are
        the stacked expert weights, adapted only when named as experts_gate / experts_up / experts_down (the group
        "experts", or a pattern over 'layers.1.mlp.experts_gate'). attention: the model's attention projections
        (`attention_projections`); naming another one is an error. mlp: a dense MLP's projections (no gate in
        Arcee's: `mlp_projections`), the others skipped. linear: the stateful layers, whose token mixer's projections
        are `mixer` (under 'layers.0.linear_attn'): Gated DeltaNet's in_qkv, in_z, in_b, in_a and out (`LINEAR`:
        Qwen3.5's), an LFM2 conv layer's in and out (`CONV`), a Mamba-2 mixer's (`MAMBA`): `linear_projections`.
        shared: the
        mixture-of-experts layers with a shared expert, whose gate / up / down are shared_gate / shared_up / shared_down
        (`SHARED`, in "all"; paths like 'layers.1.mlp.shared_expert.gate_proj'). hybrid: the layers with both
        attention and the stateful mixer (Falcon-H1's): both kinds of projections."""
        names, patterns = self.target_rules()
        named = {e.strip().removesuffix("_proj") for e in str(self.targets).split(",")}
        named |= {_BY_ATTR[e.strip()] for e in str(self.targets).split(",") if e.strip() in _BY_ATTR}
        foreign = sorted(s for s in named & set(PROJECTIONS) if PROJECTIONS[s][0] == "attn" and s not in attention)
        if foreign:
            raise ValueError(f"lora.targets names {', '.join(foreign)}, which this model's attention does not have; "
                             f"its projections are {', '.join(attention)} (or use 'attn').")
        if not linear and not hybrid and named & set(_MIXERS):
            raise ValueError(f"lora.targets names {', '.join(sorted(named & set(_MIXERS)))}, the projections of Gated "
                             f"DeltaNet or LFM2 conv layers, which this model does not have; its attention's are "
                             f"{', '.join(attention)} (or use 'attn').")
        if (linear or hybrid) and named & (set(_MIXERS) - set(mixer)):
            raise ValueError(f"lora.targets names {', '.join(sorted(named & (set(_MIXERS) - set(mixer))))}, which this "
                             f"model's stateful layers do not have; theirs are {', '.join(mixer)} (or use 'linear').")
        out = []
        for i in range(num_layers):
            moe = i in experts
            for short, (part, attr, _) in PROJECTIONS.items():
                if (part == "mlp" and (moe or short not in mlp) or part == "attn" and (short not in attention or i in linear)
                        or part == "linear_attn" and (i not in linear and i not in hybrid or short not in mixer)
                        or short in SHARED and i not in shared):
                    continue
                path = f"layers.{i}.{part}.{attr}"
                if short in names or any(p.fullmatch(path) for p in patterns):
                    out.append((i, short))
            for short in EXPERTS if moe else ():
                if short in names or any(p.fullmatch(f"layers.{i}.mlp.{short}") for p in patterns):
                    out.append((i, short))
        return out


def adapter_bytes(model_cfg: ModelConfig, cfg: LoRAConfig, itemsize: int = 4) -> int:
    """Bytes of every A and B of a decoder of shape `model_cfg` (float32 adapters: itemsize 4)."""
    d, f, h, k, hd = (model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.num_heads,
                      model_cfg.num_kv_heads, model_cfg.head_dim)
    e, fe = model_cfg.num_experts or 0, model_cfg.expert_size if model_cfg.num_experts else 0
    gated = 2 if model_cfg.gated_attention else 1  # Qwen3.5's q_proj gives each head's gate too
    dims = {"q": (d, gated * h * hd), "g": (d, h), "k": (d, k * hd), "v": (d, k * hd), "o": (h * hd, d), "gate": (d, f), "up": (d, f),
            "down": (f, d), "experts_gate": (e * d, e * fe), "experts_up": (e * d, e * fe),
            "experts_down": (e * fe, e * d)}
    if model_cfg.recurrent:
        dims.update(kind(model_cfg).adapter_dims(model_cfg))
    if model_cfg.mla is not None:
        m = model_cfg.mla
        dims.update(q_a=(d, m.q_lora_rank or 0), q_b=(m.q_lora_rank or 0, h * hd), kv_a=(d, m.kv_lora_rank + m.rope),
                    kv_b=(m.kv_lora_rank, h * (m.nope + m.v)), o=(h * m.v, d))
    width = model_cfg.shared_expert_size or 0
    dims.update(shared_gate=(d, width), shared_up=(d, width), shared_down=(width, d))
    return sum(cfg.rank * sum(dims[s]) * itemsize for _, s in model_targets(model_cfg, cfg))


def model_targets(model_cfg: ModelConfig, cfg: LoRAConfig) -> list[tuple[int, str]]:
    """`LoRAConfig.target_paths` of a decoder of shape `model_cfg` (its layers' kinds and projections)."""
    paths = cfg.target_paths(model_cfg.num_layers, expert_layers(model_cfg), attention_projections(model_cfg),
                             mlp_projections(model_cfg), linear_layers(model_cfg), shared_layers(model_cfg),
                             linear_projections(model_cfg),
                             [i for i in range(model_cfg.num_layers) if model_cfg.layer_is_hybrid(i)])
    ungated = "gate" not in mlp_projections(model_cfg)  # nor do its experts and shared experts have gates
    return [(i, s) for i, s in paths if (model_cfg.layer_has_mlp(i) or not PROJECTIONS[s][0].startswith("mlp"))
            and not (ungated and s in ("experts_gate", "shared_gate"))]


def module_at(layer: Any, part: str) -> Any:
    """The sub-module of a decoder layer that holds a projection of `PROJECTIONS` ("attn", "mlp.shared_expert", ...),
    or None where the layer has none (a dense layer's shared expert)."""
    return functools.reduce(lambda node, name: getattr(node, name, None), part.split("."), layer)


def attention_projections(model_cfg: ModelConfig) -> tuple[str, ...]:
    """The short names of a layer's attention projections: q, k, v, o (and g: LFM3's head gate); latent attention's q
    (or q_a and q_b with a query rank), kv_a, kv_b, o."""
    if model_cfg.mla is None:
        return ("q", "k", "v", "o", "g") if model_cfg.head_gate else ("q", "k", "v", "o")
    return (("q",) if model_cfg.mla.q_lora_rank is None else ("q_a", "q_b")) + ("kv_a", "kv_b", "o")


def mlp_projections(model_cfg: ModelConfig) -> tuple[str, ...]:
    """The short names of a dense MLP's projections: gate, up, down; up and down where it has no gate (Arcee)."""
    return ("gate", "up", "down") if model_cfg.gated_mlp else ("up", "down")


def linear_layers(model_cfg: ModelConfig) -> tuple[int, ...]:
    """The stateful layers of `model_cfg` (Gated DeltaNet, LFM2's conv: their projections are `linear_projections`',
    not attention's)."""
    return tuple(i for i in range(model_cfg.num_layers) if model_cfg.layer_is_linear(i))


def linear_projections(model_cfg: ModelConfig) -> tuple[str, ...]:
    """The short names of a stateful layer's projections (`mixers`' adapter_dims): Gated DeltaNet's (`LINEAR`; OLMo
    Hybrid's with q, k, v apart: `SPLIT_LINEAR`), an LFM2 conv layer's (`CONV`), a Mamba-2 mixer's (`MAMBA`)."""
    return tuple(kind(model_cfg).adapter_dims(model_cfg)) if model_cfg.recurrent else LINEAR


def expert_layers(model_cfg: ModelConfig) -> tuple[int, ...]:
    """The layers of `model_cfg` whose feed-forward is a mixture of experts (their MLP's adapters are per expert)."""
    return tuple(i for i in range(model_cfg.num_layers) if model_cfg.layer_is_moe(i))


def shared_layers(model_cfg: ModelConfig) -> tuple[int, ...]:
    """The mixture-of-experts layers of `model_cfg` with a shared expert (adapted as shared_gate / up / down)."""
    return expert_layers(model_cfg) if model_cfg.shared_expert_size else ()
