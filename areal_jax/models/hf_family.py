"""What the families with modules of their own (`models/exaone.py`, `hunyuan.py`, `seed_oss.py`, `arcee.py`,
`qwen3_5.py`, `ministral3.py`, ...) share: `common_fields` (the ModelConfig fields their config.json says as Llama's
does: sizes, RoPE, norms, special tokens), `require_fields` (the refusal of a config their transformers class would not
load as it is), `hf_dict` (the config.json they write), `text_decoder` (an image-and-text config's text decoder), the
partial rotary embeddings some read and write (`partial_rope`, `rotary_dim_of`, `rope_with_partial`) and the per-layer
attention kinds others do (`window_kinds`, `written_kinds`)."""
from __future__ import annotations

from typing import Any, Callable


def rename(name: str, pairs) -> str:
    """`name` with each (ours, theirs) of `pairs` applied in order: a substring replaced, or a compiled pattern
    substituted (a family's tensor names from the weight table's Llama ones)."""
    for ours, theirs in pairs:
        name = name.replace(ours, theirs) if isinstance(ours, str) else ours.sub(theirs, name)
    return name


def rope_of(d: dict, local_base: Callable[[dict, dict], float] | None = None) -> tuple[dict, float | None]:
    """(the global layers' rope parameters, the sliding layers' own rope base or None) of an HF config: a flat
    rope_parameters / rope_scaling, or (where the family's sliding layers have a base of their own: `local_base`, Gemma
    3's and OLMo 3's) a dictionary per layer type, whose sliding layers take the default RoPE of their own base (else
    `local_base(d, the global layers' parameters)`: Gemma's rope_local_base_freq, OLMo 3's rope_theta without the
    global layers' scaling)."""
    params = dict(d.get("rope_parameters") or {})
    local = None
    if local_base is not None:
        if "full_attention" in params or "sliding_attention" in params:
            local_params = dict(params.get("sliding_attention") or {})
            params = dict(params.get("full_attention") or {})
            if local_params.get("rope_type", "default") != "default":
                raise ValueError(f"The sliding layers have rope {local_params}; only the default RoPE is supported "
                                 "there.")
            local = local_params.get("rope_theta")
        local = float(local if local is not None else local_base(d, params))
    if d.get("rope_scaling"):
        params.update(d["rope_scaling"])
    return params, local


def reader(d: dict, defaults: dict, *, none_is_default: bool = False) -> Callable[[str], Any]:
    """`get(key)`: config.json `d`'s value of key, else transformers' default from `defaults` (None where it has none);
    with none_is_default, a key the file sets to null reads as the default too (as those families' classes do)."""
    if none_is_default:
        return lambda key: d[key] if d.get(key) is not None else defaults.get(key)
    return lambda key: d.get(key, defaults.get(key))


def common_fields(d: dict, model_type: str, defaults: dict, family: str,
                  act: str = "silu") -> tuple[dict, Callable[[str], Any]]:
    """(ModelConfig fields, get): `get(key)` reads a key of `d` with transformers' default from `defaults` where the
    file leaves it out; the fields are the architecture, sizes, head layout, RoPE (base and scaling, as `rope_of`
    reads them), norm epsilon, embedding tying, context length and special tokens. A hidden_act other than `act`
    (the family's; transformers' default where the file leaves it out) and partial rotary embeddings are refused,
    naming the family."""
    get = reader(d, defaults)

    if d.get("hidden_act", act) != act:
        raise ValueError(f"hidden_act={d['hidden_act']!r} is not {family}'s ({act!r}).")
    heads = int(get("num_attention_heads"))
    rope, _ = rope_of(d)
    theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    if float(rope.pop("partial_rotary_factor", d.get("partial_rotary_factor")) or 1.0) != 1.0:
        raise ValueError(f"partial_rotary_factor != 1 is not {family}'s (it rotates every dimension of a head).")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    eos = get("eos_token_id")
    fields = dict(
        architecture=model_type, vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
        intermediate_size=int(get("intermediate_size")), num_layers=int(get("num_hidden_layers")), num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim") or int(get("hidden_size")) // heads), rope_theta=theta,
        rope_scaling=None if rope_type == "default" else rope, rms_norm_eps=float(get("rms_norm_eps")),
        tie_word_embeddings=bool(get("tie_word_embeddings")), max_position_embeddings=int(get("max_position_embeddings")),
        bos_token_id=get("bos_token_id"), eos_token_id=tuple(eos) if isinstance(eos, list) else eos)
    return fields, get


def require_fields(cfg: Any, family: str, what: str, **wanted: Any) -> None:
    """Refuses `cfg` unless each named ModelConfig field has the wanted value; the error says what the family has
    (`what`) and lists every wanted setting, in the given order."""
    if any(getattr(cfg, key) != value for key, value in wanted.items()):
        raise ValueError(f"HF {family} has {what}; set {', '.join(f'{k}={v!r}' for k, v in wanted.items())}.")


def hf_dict(common: dict, **own: Any) -> dict:
    """A family's config.json: `common` (hf_config's keys every family writes; rope_scaling left out, the families
    write rope_parameters) with its own keys."""
    return {**{k: v for k, v in common.items() if k != "rope_scaling"}, **own}


def text_decoder(d: dict, what: str, model_type: str, tied: bool) -> dict:
    """The text decoder's config.json keys of an image-and-text config `d` (`what`: its transformers class): its
    text_config under `model_type`, with the outer file's special tokens where the inner one has none. Whether the
    output matrix is the embedding is the outer file's tie_word_embeddings, as transformers ties these models'
    weights by the outer config (`tied`: that class's default when the file leaves it out), whatever text_config says."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"model_type={d.get('model_type')!r} ({what}) needs a text_config dictionary describing its "
                         "text decoder; this config.json has none.")
    outer = {k: d[k] for k in ("bos_token_id", "eos_token_id") if d.get(k) is not None}
    return {**outer, **text, "model_type": model_type, "tie_word_embeddings": bool(d.get("tie_word_embeddings", tied))}


def partial_rope(d: dict, default: float, key: str = "partial_rotary_factor") -> tuple[dict, float]:
    """(config.json `d` as `common_fields` takes it, the share of each head that rotates): the share from its
    rope_parameters (or rope_scaling), else its top-level `key` (GPT-NeoX's older rotary_pct), else `default` (the
    family's); the RoPE base from those parameters, else the top-level rope_theta (10,000 where absent)."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    factor = float(rope.pop("partial_rotary_factor", d.get(key, default)))
    return {**d, "rope_parameters": rope, "partial_rotary_factor": None}, factor


def rotary_dim_of(head_dim: int, factor: float) -> int | None:
    """ModelConfig.rotary_dim of heads of `head_dim` rotating `factor` of their dimensions (None: all of them); an odd
    width or one below 2 is refused."""
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2:
        raise ValueError(f"partial_rotary_factor={factor} rotates {rotary} of each head's {head_dim} dimensions; an even "
                         "number of at least 2 is supported here.")
    return None if rotary == head_dim else rotary


def rope_with_partial(cfg: Any, common: dict) -> dict:
    """The rope_parameters to write: `common`'s with the share of each head that rotates (`rotary_dim`)."""
    return {**common.get("rope_parameters", {}), "partial_rotary_factor": (cfg.rotary_dim or cfg.head_dim) / cfg.head_dim}


def window_kinds(d: dict, layers: int, default: Any, family: str) -> tuple[str, ...]:
    """A config.json's layer_types (else `default`, an iterable of kinds), each full_attention or sliding_attention,
    one per layer; anything else is refused naming the family."""
    types = tuple(d.get("layer_types") or default)
    if len(types) != layers or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ValueError(f"{family}'s layer_types hold num_hidden_layers={layers} entries, each full_attention or "
                         f"sliding_attention; got {list(types)}.")
    return types


def written_kinds(cfg: Any) -> list[str]:
    """The layer_types a config.json says for `cfg`'s layers: sliding_attention where a layer has a window."""
    return ["full_attention" if cfg.layer_window(i) is None else "sliding_attention" for i in range(cfg.num_layers)]
