"""Sparse upcycling: a dense HF checkpoint into a mixture of experts that starts as the same function.

    python -m areal_jax.programs.upcycle --model=assets/math_reasoner --out=runs/math_moe --experts=4 --top_k=2

Every expert of a layer starts as a copy of that layer's dense MLP and the router as small random weights; each
token's top-k weights are renormalised to sum to 1 (`norm_topk_prob`), so whatever the router picks, a layer's output
is the dense MLP's: the upcycled model's logits equal the dense model's (up to float rounding), and training (full or
LoRA on the experts, `lora.targets=...,experts`) lets the experts and the router move apart from there. The family
maps to its mixture-of-experts sibling with the same attention: qwen2 -> qwen2_moe (Qwen2-MoE's shared expert is kept
with a zero output projection, so it adds nothing), qwen3 -> qwen3_moe, llama and mistral -> mixtral, granite ->
granitemoe, olmo2 -> flex_olmo (FlexOlmo: OLMo 2's layer with experts). Embeddings, attention, norms and the output head are copied; so is every file of the dense directory
but its weights and config.json (tokenizer files of any kind, chat template, generation config, license).
Ends with one JSON line: the parameter counts and the largest logit difference to the dense model on random tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

SIBLINGS = {"qwen2": "qwen2_moe", "qwen3": "qwen3_moe", "llama": "mixtral", "mistral": "mixtral",
            "granite": "granitemoe", "olmo2": "flex_olmo"}
SHARED_EXPERT_SIZE = 16  # Qwen2-MoE always has a shared expert: kept narrow, its output projection zero
# what the upcycled directory writes itself (weights in any format, their index, the model's config); every other file
# of the dense directory (tokenizer files of any kind, chat templates, generation config, README, LICENSE) is copied
WRITTEN = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".safetensors.index.json",
           ".bin.index.json")


def carried_files(directory: str) -> list[str]:
    """The plain files of a dense checkpoint directory that the upcycled one keeps as they are: all but the weights,
    their indexes and config.json."""
    return sorted(name for name in os.listdir(directory) if os.path.isfile(os.path.join(directory, name))
                  and name != "config.json" and not name.endswith(WRITTEN))


def upcycled_config(cfg: Any, experts: int, top_k: int) -> Any:
    """The ModelConfig of `cfg`'s mixture-of-experts sibling with `experts` copies of its MLP, top `top_k`."""
    if cfg.num_experts:
        raise ValueError(f"{cfg.architecture} is a mixture of experts already; upcycle a dense checkpoint.")
    if cfg.architecture not in SIBLINGS:
        raise ValueError(f"No mixture-of-experts sibling for {cfg.architecture!r}; upcycling takes "
                         f"{', '.join(SIBLINGS)}.")
    if not 1 <= top_k <= experts:
        raise ValueError(f"--top_k={top_k} must be between 1 and --experts={experts}.")
    arch = SIBLINGS[cfg.architecture]
    moe_width = cfg.intermediate_size if arch in ("qwen2_moe", "qwen3_moe") else None  # the others: intermediate
    return cfg.replace(architecture=arch, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                       moe_intermediate_size=moe_width, moe_layers=None,
                       shared_expert_size=SHARED_EXPERT_SIZE if arch == "qwen2_moe" else None)


def upcycle(dense: Any, experts: int, top_k: int, *, router_std: float = 0.02, seed: int = 0) -> Any:
    """A Transformer of `dense`'s sibling whose experts are copies of each layer's MLP (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from areal_jax.models import Transformer

    cfg = upcycled_config(dense.cfg, experts, top_k)
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    plain = dict(nnx.to_flat_state(nnx.state(dense)))
    keys = iter(jax.random.split(jax.random.key(seed), 2 * cfg.num_layers))
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path in plain:  # embeddings, attention, norms, head: the same names and shapes
            var.set_value(plain[path].get_value())
            continue
        layer, rest = path[1], path[3:]
        mlp = ("layers", layer, "mlp")
        if rest[0] in ("experts_gate", "experts_up", "experts_down"):
            weight = plain[mlp + (rest[0].replace("experts_", "") + "_proj",)].get_value()
            var.set_value(jnp.broadcast_to(weight, (experts, *weight.shape)).astype(var.get_value().dtype))
        elif rest[0] == "router":
            var.set_value(router_std * jax.random.normal(next(keys), var.get_value().shape, var.get_value().dtype))
        elif rest == ("shared_expert", "down_proj"):
            var.set_value(jnp.zeros_like(var.get_value()))
        elif rest[0] not in ("shared_expert", "shared_expert_gate"):
            raise KeyError(f"upcycle: no source for {'.'.join(map(str, path))}.")
    return model


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description="Upcycle a dense HF checkpoint into a mixture of experts.")
    parser.add_argument("--model", required=True, help="a dense HF checkpoint directory")
    parser.add_argument("--out", required=True, help="where to write the mixture of experts (HF directory)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top_k", type=int, default=2)
    parser.add_argument("--router_std", type=float, default=0.02, help="std of the router's random weights")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import jax.numpy as jnp
    import numpy as np

    from areal_jax.models import load_hf_checkpoint, save_hf_checkpoint

    dense = load_hf_checkpoint(args.model)
    model = upcycle(dense, args.experts, args.top_k, router_std=args.router_std, seed=args.seed)
    save_hf_checkpoint(model, args.out)
    for name in carried_files(args.model):
        shutil.copy(os.path.join(args.model, name), os.path.join(args.out, name))
    tokens = jnp.asarray(np.random.default_rng(args.seed).integers(0, dense.cfg.vocab_size, (2, 32)), jnp.int32)
    gap = float(jnp.abs(load_hf_checkpoint(args.out)(tokens) - dense(tokens)).max())
    summary = {"program": "upcycle", "from": dense.cfg.architecture, "to": model.cfg.architecture,
               "experts": args.experts, "top_k": args.top_k, "dense_params": dense.cfg.num_params,
               "params": model.cfg.num_params, "max_logit_diff": gap, "out": args.out}
    print(f"{args.model} ({dense.cfg.architecture}, {dense.cfg.num_params:,} params) -> {args.out} "
          f"({model.cfg.architecture}, {args.experts} experts, top {args.top_k}, {model.cfg.num_params:,} params); "
          f"largest logit difference to the dense model {gap:.2e}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
