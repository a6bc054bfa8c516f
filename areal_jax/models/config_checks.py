"""Checks of `ModelConfig` fields that need more than a line (kept apart so config.py stays a table of fields)."""
from __future__ import annotations


def check_longrope(scaling: dict, rope_dim: int, max_position_embeddings: int) -> None:
    """LongRoPE's keys in `scaling` (changed in place), completed as transformers completes them (factor from the
    context lengths); its factor lists become tuples of floats (the config stays hashable)."""
    if scaling.get("original_max_position_embeddings") is None:
        raise ValueError(f"rope_scaling of type 'longrope' needs original_max_position_embeddings; got {scaling}.")
    for key in ("short_factor", "long_factor"):
        values = scaling.get(key)
        if not isinstance(values, (list, tuple)) or len(values) != rope_dim // 2:
            raise ValueError(f"rope_scaling of type 'longrope' needs {key} as a list of rotary_dim / 2 = "
                             f"{rope_dim // 2} numbers; got {values!r}.")
        scaling[key] = tuple(float(v) for v in values)
    if scaling.get("factor") is None:
        scaling["factor"] = max_position_embeddings / scaling["original_max_position_embeddings"]
    scaling["use_long_factor"] = bool(scaling.get("use_long_factor", False))


def check_gated_experts(cfg) -> None:
    """gpt-oss's expert fields: the clamped GLU's limit and alpha, and biases only where there are experts."""
    limit, alpha = cfg.swiglu_limit, cfg.swiglu_alpha
    if limit is not None and not (isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0):
        raise ValueError(f"ModelConfig.swiglu_limit must be a positive number or None, got {limit!r}.")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 0):
        raise ValueError(f"ModelConfig.swiglu_alpha must be a positive number, got {alpha!r}.")
    if (cfg.expert_bias or limit is not None) and not cfg.num_experts:
        raise ValueError("ModelConfig.expert_bias and swiglu_limit apply to a mixture of experts; this config has "
                         "num_experts=0. Leave them at False / None.")
