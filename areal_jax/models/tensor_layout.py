"""How a family's checkpoint stores the tensors that a change of name alone does not reach: q/k/v or gate and up
fused in one tensor, a layer's experts one tensor each or stacked, where a router's picking bias lies, how a Gated
DeltaNet's input projections are split. `hf_names.weight_entries` builds a model's tensor table from its family's
`Layout` (a `base_families` row's `layout`, an own module's `LAYOUTS`), then applies the family's renames (its
`hf_name`): the table itself knows layouts, not families."""
from __future__ import annotations

from dataclasses import dataclass

from areal_jax.models.hf_family import rename

_CHOICES = {
    "qkv": ("apart", "fused", "per_head"),
    "gate_up": ("apart", "fused"),
    "experts": ("apart", "stacked", "interleaved"),
    "score_bias": ("gate", "beside", "statics"),
    "linear": ("apart", "qkvz", "named"),
}


@dataclass(frozen=True)
class Layout:
    """qkv: "apart" (q_proj, k_proj, v_proj), "fused" (one qkv_proj: the q rows, then k's, then v's: Phi-3), "per_head"
    (one query_key_value, head by head its q, k and v rows: GPT-NeoX).
    gate_up: "apart" (gate_proj, up_proj), "fused" (one gate_up_proj: the gate rows, then up's: Phi-3, GLM, GLM-4,
    Granite 4.0).
    experts: "apart" (mlp.experts.{j}.{gate,up,down}_proj, one tensor each), "stacked" (Granite's block_sparse_moe:
    input_linear [E, 2F, D] of gate rows then up rows, output_linear [E, D, F], router.layer; its shared MLP's
    input_linear fused the same way), "interleaved" (gpt-oss: experts.gate_up_proj [E, D, 2F] with gate at even
    columns and up at odd ones, down_proj, their biases, router weight and bias).
    score_bias: where DeepSeek-V3-style routing keeps its picking bias: "gate" (mlp.gate.e_score_correction_bias),
    "beside" (beside the gate: MiniMax-M2, EXAONE MoE), "statics" (mlp.moe_statics.e_score_correction_bias, [1, E]:
    ERNIE 4.5).
    linear: a Gated DeltaNet layer's input projections: "apart" (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a:
    Qwen3.5), "qkvz" (in_proj_qkvz and in_proj_ba, fused key head by key head: Qwen3-Next), "named" (q/k/v/g/b/a_proj
    apart, o_norm and o_proj: OLMo Hybrid)."""

    qkv: str = "apart"
    gate_up: str = "apart"
    experts: str = "apart"
    score_bias: str = "gate"
    linear: str = "apart"

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"Layout.{name}={getattr(self, name)!r}: choose one of {choices}")


LLAMA = Layout()


def block_sparse_moe(name: str) -> str:
    """Mixtral's names of a mixture-of-experts layer (MiniMax-M2's and PhiMoE's too) from the table's Qwen3-MoE ones:
    the layer's mlp is its block_sparse_moe; an expert's gate_proj, up_proj and down_proj are its w1, w3 and w2."""
    if ".mlp.experts." in name:
        name = rename(name, ((".gate_proj.", ".w1."), (".up_proj.", ".w3."), (".down_proj.", ".w2.")))
    return rename(name, ((".mlp.gate.", ".block_sparse_moe.gate."), (".mlp.experts.", ".block_sparse_moe.experts."),
                         (".mlp.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias")))
