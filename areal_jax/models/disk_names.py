"""Checkpoint tensors stored under names or in pieces other than the weight table's (`hf_names`), as transformers
renames and joins them on loading (its conversion mapping): OLMo Hybrid's norms (`add_aliases`) and its Gated DeltaNet
convolution kept as three tensors (`parts`). `hf_io`'s reader answers the table's names from them."""
from __future__ import annotations

import re
from typing import Container

# (on disk, in the table): OLMo Hybrid's, its Gated DeltaNet layers' norms before the mixer and before the MLP (and,
# as transformers writes them back, its attention layers' norm after attention too)
ALIASES = ((".attention_layer_norm.", ".input_layernorm."), (".feedforward_layer_norm.", ".post_attention_layernorm."),
           ("lm_head.", "embed_out."))  # (and GPT-NeoX's head, transformers' lm_head, released as embed_out)
# (on disk and in the table, in transformers' module) where a family's module is named otherwise than its tensor:
# LFM3's head gate (gate_proj on disk, g_proj in the module); Nemotron-H's backbone (model in the module)
MODULE_NAMES = {"lfm3": ((".self_attn.gate_proj.", ".self_attn.g_proj."),), "nemotron_h": (("backbone.", "model."),),
                "gpt_neox": (("embed_out.", "lm_head."),)}
# a tensor the table names whole and a checkpoint may hold as pieces along the first axis, in this order
PIECES = {".linear_attn.conv1d.weight": (".linear_attn.q_conv1d.weight", ".linear_attn.k_conv1d.weight",
                                         ".linear_attn.v_conv1d.weight")}


# whole names transformers' conversion renames on loading, every pattern in turn: EXAONE 3's transformer.* tensors
CONVERSIONS = ("transformer.", tuple((re.compile(a), b) for a, b in (
    (r"^transformer\.wte\.", "model.embed_tokens."), (r"^transformer\.h\.", "model.layers."),
    (r"^transformer\.ln_f\.", "model.norm."), (r"\.attn\.attention\.", ".self_attn."),
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."), (r"\.ln_1\.", ".input_layernorm."),
    (r"\.ln_2\.", ".post_attention_layernorm."), (r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."),
    (r"\.mlp\.c_fc_1\.", ".mlp.up_proj."), (r"\.mlp\.c_proj\.", ".mlp.down_proj."))))


def add_aliases(names: dict[str, str]) -> None:
    """Adds to {table name: name on disk} the table's names of tensors stored under `ALIASES`' names, and those of
    the whole names `CONVERSIONS` renames (in place; a name the checkpoint holds itself wins)."""
    prefix, patterns = CONVERSIONS
    for name in list(names):
        for theirs, ours in ALIASES:
            if theirs in name:
                names.setdefault(name.replace(theirs, ours), names[name])
        if name.startswith(prefix):
            renamed = name
            for pattern, new in patterns:
                renamed = pattern.sub(new, renamed)
            names.setdefault(renamed, names[name])


def in_memory(name: str, architecture: str) -> str:
    """The name transformers' module gives a tensor the table names `name` (as a checkpoint holds it)."""
    for disk, module in MODULE_NAMES.get(architecture, ()):
        name = name.replace(disk, module)
    return name


def parts(name: str, names: Container[str]) -> tuple[str, ...] | None:
    """The tensors whose concatenation along the first axis is `name`, where the checkpoint (its tensor `names`) holds
    `name` in pieces (`PIECES`: whatever each piece's length, transformers joins them so; it writes them back as equal
    thirds); None where it holds `name` itself or no pieces of it."""
    if name in names:
        return None
    for whole, pieces in PIECES.items():
        if name.endswith(whole):
            found = tuple(name[: -len(whole)] + p for p in pieces)
            if all(p in names for p in found):
                return found
    return None
