"""Helpers of the HF transformers parity tests (PyTorch is imported on use): random O(1) weights, logits, tokens."""
from __future__ import annotations

import os

import numpy as np


def randomize_torch(model, seed: int, norm_center: float = 1.0):
    """HF initialises biases to 0 and norms to 1; draw them (and O(1)-scale weights) so every tensor matters. Norm
    weights are norm_center + N(0, 0.1) (0 for Gemma, whose norms scale by 1 + w); matrices N(0, 1 / fan_in),
    except the embedding (a stack of experts' [E, out, in]: each expert's fan_in); everything else N(0, 1).
    Returns the model."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(norm_center + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif p.ndim >= 2 and "embed_tokens" not in name:
                p.copy_(noise / p.shape[-1] ** 0.5)
            else:
                p.copy_(noise)
    return model


def hf_logits(model, tokens, positions=None) -> np.ndarray:
    """A transformers model's float32 logits for int tokens [B, T] (and explicit positions [B, T])."""
    import torch

    with torch.no_grad():
        kwargs = {} if positions is None else {"position_ids": torch.tensor(np.asarray(positions))}
        return model(torch.tensor(np.asarray(tokens)), **kwargs).logits.float().numpy()


def random_tokens(vocab: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def hf_model_of(cfg, seed: int):
    """transformers' model of a ModelConfig, built from the config.json it writes (`ModelConfig.to_hf_dict`), its
    weights drawn by `randomize_torch` and any picking-bias buffer (e_score_correction_bias: DeepSeek-V3, GLM,
    MiniMax-M2; LFM2-MoE's expert_bias; a buffer, not a parameter) drawn too, large enough to change picks. Returns the model in eval mode."""
    import torch
    import transformers

    d = cfg.to_hf_dict()
    model_class = getattr(transformers, d["architectures"][0])
    hf_cfg = model_class.config_class(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    model = randomize_torch(model_class(hf_cfg).eval(), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # (LFM2-MoE's: expert_bias)
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=gen))
    return model


def assert_parity_and_round_trips(tmp_path, cfg, hf, tokens, attentions=("dense", "blocked"), atol: float = 1e-4):
    """The checkpoint of transformers' model `hf` loads here as `cfg` with hf's logits on each cache-free attention
    path, and what this project saves loads in transformers as the same class with bit-equal logits."""
    import jax.numpy as jnp
    import torch
    import transformers

    from areal_jax.models import load_hf_checkpoint, save_hf_checkpoint

    hf.save_pretrained(tmp_path / "hf")
    ref = hf_logits(hf, tokens)
    assert np.abs(ref).max() > 1.0  # the weights are large enough for the comparison to mean something
    ours = load_hf_checkpoint(tmp_path / "hf")
    assert ours.cfg == cfg
    for attention in attentions:
        got = np.asarray(ours.unembed(ours.hidden(jnp.asarray(tokens), attention=attention)))
        np.testing.assert_allclose(got, ref, atol=atol, rtol=0, err_msg=attention)
    save_hf_checkpoint(ours, tmp_path / "ours")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(again) is type(hf)
    np.testing.assert_array_equal(hf_logits(again, tokens), ref)
    return ours


def rewrapped_logits(model, source_dir, work_dir, hf_class, tokens) -> np.ndarray:
    """`model` (the text decoder of the image-and-text checkpoint at `source_dir`) saved text-only and written back
    into that checkpoint under `work_dir` (models.wrapped_export.rewrap, as the export program does); the logits of
    transformers' `hf_class` loaded from the result, on `tokens`."""
    import torch

    from areal_jax.models import save_hf_checkpoint
    from areal_jax.models.wrapped_export import rewrap

    save_hf_checkpoint(model, os.path.join(work_dir, "text"))
    copied = rewrap(os.path.join(work_dir, "text"), source_dir, os.path.join(work_dir, "whole"))
    assert copied, "the image-and-text checkpoint had no tensors outside its text decoder"
    whole = hf_class.from_pretrained(os.path.join(work_dir, "whole"), dtype=torch.float32).eval()
    return hf_logits(whole, tokens)


def randomize_lora_b(model, scale: float, offset: int = 100) -> None:
    """Every adapter's B (`lora.apply_lora` starts it at zero, where the adapters change nothing) drawn from a normal
    of std `scale`: the node at index i of the model's graph walk takes key offset + i."""
    import jax
    from flax import nnx

    from areal_jax.models import lora

    for i, (_, node) in enumerate(nnx.iter_graph(model)):
        if isinstance(node, (lora.LoRAProjection, lora.LoRAExperts)):
            node.lora_b.set_value(scale * jax.random.normal(jax.random.key(offset + i), node.lora_b.shape))


def assert_peft_round_trip(out, base, model, lcfg, tokens, hf_class: str = "AutoModelForCausalLM",
                           atol: float = 1e-4) -> None:
    """`model`'s adapters, exported to the PEFT directory `out` over the checkpoint at `base`: they change the logits
    (so peft found every one of them), peft applies them to transformers' `hf_class` with our logits, and reading the
    directory back into fresh adapters gives the same ones, bit for bit."""
    import jax
    import jax.numpy as jnp
    import peft
    import torch
    import transformers
    from flax import nnx

    from areal_jax.models import load_hf_checkpoint, lora
    from areal_jax.models.peft_io import load_peft_adapter

    hf = getattr(transformers, hf_class).from_pretrained(base, dtype=torch.float32).eval()
    ids = torch.tensor(np.asarray(tokens))
    with torch.no_grad():
        plain = hf(input_ids=ids).logits.numpy()
        got = peft.PeftModel.from_pretrained(hf, out).eval()(input_ids=ids).logits.numpy()
    want = np.asarray(model(jnp.asarray(tokens)))
    assert np.abs(want - plain).max() > 1e-2
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    back = load_hf_checkpoint(base)
    lora.apply_lora(back, lcfg, rngs=nnx.Rngs(7))
    load_peft_adapter(back, out)
    for x, y in zip(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)), jax.tree.leaves(nnx.state(back, nnx.LoRAParam)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def peft_exported(base, out, targets: str, *, rank: int = 2, alpha: float = 6.0, scale: float = 0.3):
    """The checkpoint at `base` loaded with LoRA adapters on `targets` (their B drawn: `randomize_lora_b`) and the
    adapters exported to the PEFT directory `out` over it: (model, its LoRAConfig, the directory)."""
    from flax import nnx

    from areal_jax.models import load_hf_checkpoint, lora
    from areal_jax.models.peft_io import save_peft_adapter

    model = load_hf_checkpoint(base)
    lcfg = lora.LoRAConfig(rank=rank, alpha=alpha, targets=targets)
    lora.apply_lora(model, lcfg, rngs=nnx.Rngs(1))
    randomize_lora_b(model, scale)
    return model, lcfg, save_peft_adapter(model, lcfg, out, base_model_name_or_path=str(base))


def ours_of_their_class(tmp_path, model_class, config, tokens, atol: float = 1e-4):
    """transformers' `model_class(config)` with random O(1) weights (`randomize_torch`, seed 0), saved and loaded here:
    returns our model, whose logits on `tokens` are checked equal to transformers' (within atol)."""
    import jax.numpy as jnp
    import torch

    from areal_jax.models import load_hf_checkpoint

    torch.manual_seed(0)
    hf = randomize_torch(model_class(config).float().eval(), 0)
    hf.save_pretrained(tmp_path)
    ours = load_hf_checkpoint(tmp_path)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(tokens))), hf_logits(hf, tokens), atol=atol, rtol=0)
    return ours
