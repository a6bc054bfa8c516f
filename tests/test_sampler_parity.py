"""Greedy generate_batch against HF transformers' generate(do_sample=False) on the same checkpoint."""
from __future__ import annotations

import numpy as np
import pytest

from areal_jax.models import load_hf_checkpoint
from areal_jax.sampler import generate_batch
from areal_jax.testing import models as testing

torch = pytest.importorskip("torch", reason="parity with HF transformers needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="parity needs transformers (pip install transformers)")

MAX_NEW = 12
EOS = 2
TIE_TOL = 2e-4  # logits are O(1-10); float32 cache-vs-no-cache paths agree to ~1e-5


def hf_greedy(hf_model, prompt):
    """HF greedy continuation of one prompt: (tokens, per-step logits [n, V])."""
    ids = torch.tensor([prompt], dtype=torch.long)
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                            eos_token_id=EOS, pad_token_id=0, output_scores=True,
                            return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    scores = torch.stack(out.scores, dim=0)[:, 0].double().numpy()
    return tokens, scores


@pytest.mark.parity
@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "llama"])
def test_greedy_generate_batch_matches_transformers(tmp_path, architecture):
    cfg = testing.tiny_config(architecture, eos_token_id=EOS)
    testing.write_random_hf_checkpoint(tmp_path, cfg, seed=4)
    model = load_hf_checkpoint(tmp_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, cfg.vocab_size, size=n).tolist() for n in (1, 5, 17, 40, 9)]
    ours = generate_batch(model, prompts, max_new_tokens=MAX_NEW, temperature=0.0, stop_token_ids=(EOS,),
                          num_slots=2)
    diverged = 0
    for prompt, c in zip(prompts, ours):
        want, scores = hf_greedy(hf_model, prompt)
        assert c.finish_reason == ("stop" if want[-1] == EOS else "length")
        got = c.tokens.tolist()
        for i, w in enumerate(want):
            if got[i] != w:
                gap = abs(scores[i][w] - scores[i][got[i]])
                assert gap < TIE_TOL, f"prompt {len(prompt)} tokens, step {i}: {got[i]} vs HF {w}, gap {gap:.2e}"
                diverged += 1
                break
            logp = scores[i] - np.log(np.exp(scores[i] - scores[i].max()).sum()) - scores[i].max()
            assert abs(c.logprobs[i] - logp[w]) < 1e-4
        else:
            assert got == want
    assert diverged <= 1, "more than one near-tie divergence is suspicious"
