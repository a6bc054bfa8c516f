"""Helpers of the HF transformers parity tests (PyTorch is imported on use): random O(1) weights, logits, tokens."""
from __future__ import annotations

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
