"""Tiny model configs for tests: `tiny_config` (every family at a small, odd size) and `wide_hybrid_config`."""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from areal_jax.models.config import ModelConfig
from areal_jax.models.config_checks import MLA


def tiny_config(architecture: str = "qwen2", **overrides: Any) -> ModelConfig:
    """A 2-layer float32 model with odd sizes: hidden 64, 4 heads, 2 kv heads, head_dim 16, vocab 97.

    Architecture defaults follow HF: qwen2 has q/k/v bias, qwen3 and gemma3 have q/k norm, llama uses llama3 RoPE
    scaling, gemma3 and olmo3 slide a window of 8 over every layer but the second (Gemma with its own local RoPE
    base there), smollm3 leaves every second layer without rotary embeddings, phi3 rotates 12 of 16 dimensions
    with LongRoPE, gemma2 slides every other layer and soft-caps attention scores (3) and logits (5), qwen3_moe
    (q/k norm), mixtral, granitemoe, granitemoeshared and granitemoe_swa (an ungated shared MLP of width 24), olmoe (q/k norm over all
    heads) and qwen2_moe (q/k/v bias, a shared expert of
    width 40) route each token to 2 of 4 experts (of width 32 for qwen3_moe and qwen2_moe; renormalised weights but
    for qwen2_moe), the granite types take Granite's four scalars (granite_swa and granitemoe_swa: windows, sinks and
    RoPE bases as at their branch); gpt_oss routes to 2 of 4
    experts with biases and the clamped GLU (limit 1, which bites at O(1) weights), biases on q/k/v/o, attention sinks, and slides a
    window of 8 over every other layer; exaone4 (and exaone_moe, whose experts are written at its branch) slides a
    window of 8 over every layer but the second, which skips RoPE; hunyuan_v1_dense (and hunyuan_v1_moe, experts at
    its branch) normalises q and k after RoPE; seed_oss has q/k/v and o biases; arcee's MLP has no gate (ReLU
    squared); ministral3 takes YaRN with a pretraining length of 8 and scales its queries by
    1 + 0.5 ln(1 + floor(position / 8)); deepseek_v3, deepseek_v2, glm4_moe, glm4_moe_lite, dots1, minimax_m2, glm4, ernie4_5
    and ernie4_5_moe, qwen3_5_text, qwen3_5_moe_text, qwen3_next, phimoe as written at their branches below;
    flex_olmo: OLMo 2's layer with olmoe's experts (2 of 4, renormalised); lfm2, lfm2_moe, lfm3, olmo_hybrid,
    bamba, nemotron_h, falcon_h1, jamba, mamba, falcon_mamba, mamba2, cohere, cohere2, starcoder2, gpt_neox, phi,
    glm, helium, ministral, apertus, stablelm, exaone (Llama's), olmo, jais2, nemotron, cwm, youtu and nanochat as at their
    branches. Any ModelConfig field can be overridden."""
    fields: dict[str, Any] = dict(
        architecture=architecture, vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=256, bos_token_id=1,
        eos_token_id=2, rope_interleave=architecture == "helium",  # (Helium's pairs: interleaved)
        attention_bias=architecture in ("qwen2", "qwen2_moe", "gpt_oss", "seed_oss"),
        attention_out_bias=architecture == "seed_oss",
        qk_norm=architecture in ("qwen3", "qwen3_moe", "gemma3", "olmo2", "olmo3", "olmoe", "exaone4", "hunyuan_v1_dense",
                                 "hunyuan_v1_moe", "flex_olmo", "apertus"),
        dtype=jnp.float32,
        param_dtype=jnp.float32,
    )
    if architecture in ("llama", "cwm", "apertus", "exaone"):  # (CWM's windows, Apertus' q/k norms and xIELU: their branches)
        fields.update(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    layers = int(overrides.get("num_layers", 2))
    if architecture == "gemma2":  # every other layer slides; soft caps small enough to bite at this size
        fields.update(sliding_window=8, query_pre_attn_scalar=24.0, attn_logit_softcap=3.0, final_logit_softcap=5.0,
                      layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)))
    if architecture == "gemma3":
        fields.update(sliding_window=8, rope_local_theta=10000.0, rope_theta=1000000.0, query_pre_attn_scalar=16.0,
                      layer_types=tuple("full_attention" if i % 6 == 1 else "sliding_attention" for i in range(layers)))
    if architecture in ("cohere", "cohere2"):  # interleaved pairs rotate, logits x 1/4; Cohere 2: every fourth layer
        # from the fourth full attention without RoPE, the others sliding (and rotating)
        full = tuple((i + 1) % 4 == 0 for i in range(layers)) if architecture == "cohere2" else None
        fields.update(rope_interleave=True, logits_scaling=4.0, rms_norm_eps=1e-5, **({} if full is None else dict(
            sliding_window=8, layer_types=tuple("full_attention" if f else "sliding_attention" for f in full),
            rope_layers=tuple(int(not f) for f in full))))
    if architecture in ("starcoder2", "gpt_neox", "phi", "jais2"):  # LayerNorms, ungated GELU (Jais 2: relu2) MLPs,
        # biases; a window (StarCoder2)
        own = {"starcoder2": dict(sliding_window=8), "gpt_neox": dict(num_kv_heads=4, rotary_dim=4),
               "phi": dict(num_kv_heads=4, rotary_dim=6, lm_head_bias=True)}.get(architecture, {})
        fields.update(attention_bias=True, attention_out_bias=True, mlp_bias=True, rms_norm_eps=1e-5, **own)
    if architecture == "nemotron":  # LayerNorm1P (1 + w, and a bias), an ungated relu^2 MLP, half of each head rotating
        fields.update(rotary_dim=8, rms_norm_eps=1e-5)
    if architecture == "smollm3":  # its NoPE layers: the second of every pair here
        fields.update(rope_layers=tuple(i % 2 == 0 for i in range(layers)))
    if architecture == "phi3":  # Phi-4-mini's form: 3/4 of each head rotates, LongRoPE (short factors by default)
        fields.update(rotary_dim=12, rope_scaling={
            "rope_type": "longrope", "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.1, 1.3, 1.8, 2.5, 3.0], "long_factor": [1.0, 1.5, 2.7, 5.0, 9.0, 16.0]})
    if architecture in ("qwen3_moe", "mixtral", "granitemoe", "granitemoeshared", "granitemoe_swa", "olmoe", "qwen2_moe",
                        "flex_olmo"):
        ungated = architecture in ("granitemoeshared", "granitemoe_swa")
        fields.update(num_experts=4, num_experts_per_tok=2, norm_topk_prob=architecture != "qwen2_moe",
                      moe_intermediate_size=32 if architecture in ("qwen3_moe", "qwen2_moe") else None,
                      shared_expert_size=24 if ungated else 40 if architecture == "qwen2_moe" else None,
                      shared_expert_gated=not ungated)
    if architecture in ("granite_swa", "granitemoe_swa"):  # the first of every four layers full, the others sliding a
        # window of 8 with a RoPE base of their own; a sink logit per head
        fields.update(sliding_window=8, rope_local_theta=50000.0, attention_sinks=True,
                      layer_types=tuple("full_attention" if i % 4 == 0 else "sliding_attention" for i in range(layers)))
    if architecture == "gpt_oss":
        fields.update(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, expert_bias=True, swiglu_limit=1.0,
                      attention_out_bias=True, attention_sinks=True, sliding_window=8,
                      layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)))
    if architecture.startswith("granite"):  # granite-3.x-2b's scalars but the logits', kept small enough to matter
        fields.update(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                      logits_scaling=2.0)
    if architecture == "olmo3":
        fields.update(sliding_window=8, rope_local_theta=500000.0, rope_theta=500000.0,
                      layer_types=tuple("full_attention" if i % 4 == 1 else "sliding_attention" for i in range(layers)))
    if architecture in ("exaone4", "exaone_moe"):  # EXAONE-4.0-32B's form: the global layers (the second here)
        # without RoPE; EXAONE MoE's: that attention, a dense first layer, then DeepSeek-V3's router over 2 of 8
        # experts in the best 2 of 4 groups, times 2.5, and one shared expert
        types = tuple("full_attention" if i % 4 == 1 else "sliding_attention" for i in range(layers))
        fields.update(sliding_window=8, layer_types=types, rope_layers=tuple(int(t != "full_attention") for t in types),
                      qk_norm=True)
    if architecture == "exaone_moe":
        fields.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_size=16,
                      shared_expert_gated=False, norm_topk_prob=True, router_scoring="sigmoid", router_groups=(4, 2),
                      router_score_bias=True, routed_scaling_factor=2.5,
                      moe_layers=tuple(int(i > 0) for i in range(layers)))
    if architecture == "deepseek_v3":  # latent attention (query rank 24, latent 16, 12 + 8 rotary dims, values of
        # 10), YaRN with mscale_all_dim; a dense first layer, then 2 of 8 experts in the best 2 of 4 groups, sigmoid
        # scores with a picking bias, times 2.5; two ungated shared experts
        fields.update(num_kv_heads=4, head_dim=20, mla=MLA(24, 16, 12, 8, 10), num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_size=32, shared_expert_gated=False, norm_topk_prob=True,
                      router_scoring="sigmoid", router_groups=(4, 2), router_score_bias=True, routed_scaling_factor=2.5,
                      moe_layers=tuple(int(i > 0) for i in range(layers)), rope_scaling={
                          "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                          "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    if architecture == "nanochat":  # (its own layer form: unscaled norms, q/k normed after RoPE, relu^2, capped logits)
        fields.update(qk_norm=True, final_logit_softcap=5.0)
    if architecture == "youtu":  # deepseek_v3's latent attention (with its YaRN) before dense MLPs, tied embeddings
        fields.update(num_kv_heads=4, head_dim=20, mla=MLA(24, 16, 12, 8, 10), tie_word_embeddings=True, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})
    if architecture == "deepseek_v2":  # DeepSeek-V2-Lite's form: queries without a rank; softmax routing within
        # the best 2 of 4 groups (group_limited_greedy), unrenormalised, times 1.5; YaRN with mscale 0.707
        fields.update(num_kv_heads=4, head_dim=20, mla=MLA(None, 16, 12, 8, 10), num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_size=32, shared_expert_gated=False, router_groups=(4, 2),
                      routed_scaling_factor=1.5, moe_layers=tuple(int(i > 0) for i in range(layers)), rope_scaling={
                          "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.707,
                          "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})
    if architecture == "glm4_moe_lite":  # GLM-4.7-Flash's form: DeepSeek-V3's layer (here without YaRN)
        fields.update(num_kv_heads=4, head_dim=20, mla=MLA(24, 16, 12, 8, 10), num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_size=16, shared_expert_gated=False, norm_topk_prob=True,
                      router_scoring="sigmoid", router_groups=(4, 2), router_score_bias=True, routed_scaling_factor=1.8,
                      moe_layers=tuple(int(i > 0) for i in range(layers)))
    if architecture == "glm4_moe":  # GLM-4.5's form: q/k/v bias, q/k norm (GLM-4.5; not -Air), half of each head
        # rotating, a dense first layer, then DeepSeek-V3's router over 2 of 8 experts in the best 2 of 4 groups
        fields.update(attention_bias=True, qk_norm=True, rotary_dim=8, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_size=16, shared_expert_gated=False, norm_topk_prob=True,
                      router_scoring="sigmoid", router_groups=(4, 2), router_score_bias=True, routed_scaling_factor=2.5,
                      moe_layers=tuple(int(i > 0) for i in range(layers)), rope_theta=1e6)
    if architecture == "dots1":  # dots.llm1's form: q/k norms, a window of 8 in the second layer on, a dense first
        # layer, then DeepSeek-V3's router over 2 of 8 experts (one group), unrenormalised, and a shared expert
        fields.update(qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_size=16, shared_expert_gated=False, norm_topk_prob=False, router_scoring="sigmoid",
                      router_score_bias=True, routed_scaling_factor=2.5, moe_layers=tuple(int(i > 0) for i in range(layers)),
                      sliding_window=8, layer_types=tuple("sliding_attention" if i else "full_attention" for i in range(layers)))
    if architecture == "hunyuan_v1_moe":  # Hunyuan-A13B's form: 2 of 8 experts of intermediate_size in every layer,
        # softmax weights renormalised, and an ungated shared MLP of that width
        fields.update(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, shared_expert_size=96,
                      shared_expert_gated=False)
    if architecture == "minimax_m2":  # q/k norm over all heads, half of each head rotating; 2 of 8 experts of
        # intermediate_size in every layer by sigmoid scores with a picking bias, renormalised
        fields.update(qk_norm=True, rotary_dim=8, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      router_scoring="sigmoid", router_score_bias=True, rope_theta=5e6)
    if architecture == "ministral3":  # YaRN, and queries scaled past each multiple of the pretraining length (8)
        fields.update(rope_theta=1e6, rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 8,
                                                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                                                    "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5})
    if architecture in ("glm4", "glm"):  # GLM-4's form: q/k/v bias, half of each head rotating as interleaved pairs
        fields.update(attention_bias=True, rotary_dim=8, rope_interleave=True)
    if architecture in ("ernie4_5", "ernie4_5_moe"):  # RoPE on interleaved pairs; the MoE's: a dense first layer,
        # then 2 of 8 experts picked by softmax probabilities plus a bias, renormalised, and two shared experts
        fields.update(rope_interleave=True, rope_theta=500000.0, eos_token_id=2)
    if architecture == "ernie4_5_moe":
        fields.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                      router_score_bias=True, shared_expert_size=32, shared_expert_gated=False,
                      moe_layers=tuple(int(i > 0) for i in range(layers)))
    if architecture == "qwen3_5_moe_text":  # Qwen3.5-MoE's: 2 of 4 experts of width 32 and a gated shared one of 40
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      shared_expert_size=40, intermediate_size=32)  # (no dense MLP: it reads intermediate_size so)
    if architecture == "qwen3_next":  # Qwen3.5-MoE's layer with a dense MLP (width 96) in the first layer
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      shared_expert_size=40, moe_layers=tuple(int(i > 0) for i in range(layers)))
    if architecture == "phimoe":  # Phi-3.5-MoE's form: LayerNorms, q/k/v/o and output biases, LongRoPE with its
        # mscales, 2 of 4 experts of intermediate_size by sparsemixer, its margin wide enough to keep several experts
        fields.update(attention_bias=True, attention_out_bias=True, lm_head_bias=True, num_experts=4,
                      num_experts_per_tok=2, router_scoring="sparsemixer", router_jitter=0.3, rope_scaling={
                          "rope_type": "longrope", "original_max_position_embeddings": 32, "short_mscale": 1.2,
                          "long_mscale": 1.3, "short_factor": [1.0, 1.1, 1.3, 1.8, 2.5, 3.0, 3.5, 4.0],
                          "long_factor": [1.0, 1.5, 2.7, 5.0, 9.0, 16.0, 20.0, 24.0]})
    if architecture in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):  # Qwen3.5's form: Gated DeltaNet (2 key heads of 8, 4 value heads of 12, 4 taps)
        # but in the second layer of each four: gated attention there, q/k norm, a quarter of each head rotating
        fields.update(qk_norm=True, rotary_dim=4, linear=(2, 4, 8, 12, 4), layer_types=tuple(
            "full_attention" if i % 4 == 1 else "linear_attention" for i in range(layers)))
    if architecture in ("lfm2", "lfm2_moe"):  # LFM2's form: short convolutions of 3 taps but in the second layer of each
        # four, attention there with q/k norm; tied embeddings. The MoE's: a dense first layer, then 2 of 4 experts of
        # width 32 by sigmoid scores with a picking bias, renormalised
        fields.update(qk_norm=True, rope_theta=1e6, tie_word_embeddings=True, short_conv=3, layer_types=tuple(
            "full_attention" if i % 4 == 1 else "conv" for i in range(layers)))
    if architecture == "lfm3":  # LFM3's form: attention (global, proportional RoPE turning half the pairs, base 1e6),
        # conv (4 taps), sliding attention (window 6, base 1e4), conv, ...; per-head output gates; four norms a layer
        types = tuple(("full_attention", "conv", "sliding_attention", "conv")[i % 4] for i in range(layers))
        sliding = "sliding_attention" in types  # (a window and its base only where a layer slides, as read back)
        fields.update(qk_norm=True, rope_theta=1e6, tie_word_embeddings=True, short_conv=4, head_gate=True,
                      sliding_window=6 if sliding else None, rope_local_theta=1e4 if sliding else None,
                      rope_scaling={"rope_type": "proportional", "partial_rotary_factor": 0.5}, layer_types=types)
    if architecture == "olmo_hybrid":  # OLMo Hybrid's form: Gated DeltaNet (2 key heads of 8, 4 value heads of 12, 4 taps,
        # write strength 2 sigmoid(b)) pre-norm but in the second layer of each four: OLMo 3's attention there
        fields.update(qk_norm=True, linear=(2, 4, 8, 12, 4, 2.0), layer_types=tuple(
            "full_attention" if i % 4 == 1 else "linear_attention" for i in range(layers)))
    if architecture == "bamba":  # Bamba's form: Mamba-2 mixers (4 heads of 32, 2 groups of 16, 4 taps) but in the
        # second layer of each four, attention there rotating half of each head
        fields.update(rotary_dim=8, mamba=(4, 32, 16, 2, 4), layer_types=tuple(
            "full_attention" if i % 4 == 1 else "linear_attention" for i in range(layers)))
    if architecture == "nemotron_h":  # Nemotron-H's form: Mamba-2 mixers (as bamba's) but in the second layer of each
        # four, attention there with no position embeddings; every third layer from the first without an MLP
        fields.update(mamba=(4, 32, 16, 2, 4), rope_layers=(0,) * layers, rms_norm_eps=1e-5,
                      layer_types=tuple("full_attention" if i % 4 == 1 else "linear_attention" for i in range(layers)),
                      mlp_layers=tuple(int(i % 3 != 0) for i in range(layers)))
    if architecture == "falcon_h1":  # Falcon-H1's form: attention and a Mamba-2 mixer (4 heads of 24 (d_ssm 96), 2
        # groups of 16, 4 taps; no norm) side by side in every layer, each multiplier away from 1
        fields.update(mamba=(4, 24, 16, 2, 4, None), layer_types=("hybrid",) * layers, embedding_multiplier=1.5,
                      hybrid_scales=(0.8, 1.3, 0.7, 1.1, 0.6, (0.9, 1.2, 0.8, 1.25, 0.7), 1.4, 0.75, 0.9))
    if architecture == "jamba":  # Jamba's form: Mamba mixers (128 channels of 8 states, a time step of rank 4, 4 taps)
        # but in the second layer of each four: attention there, with no position embeddings
        fields.update(mamba1=(128, 8, 4, 4), rope_layers=(0,) * layers, layer_types=tuple(
            "full_attention" if i % 4 == 1 else "linear_attention" for i in range(layers)))
    if architecture in ("mamba", "falcon_mamba", "mamba2"):  # Mamba mixers alone (128 channels of 8 states, rank 4, 4
        # taps; Falcon-Mamba's unscaled norms with an epsilon of their own), or Mamba-2's (as bamba's; untied), no MLP
        falcon = ("plain", 1e-5) if architecture == "falcon_mamba" else (None, None)
        fields.update(**{"mamba2": {"mamba": (4, 32, 16, 2, 4)}}.get(architecture, {"mamba1": (128, 8, 4, 4, *falcon)}), layer_types=("linear_attention",) * layers, mlp_layers=(0,) * layers, num_heads=1,
                      num_kv_heads=1, head_dim=2, intermediate_size=1, tie_word_embeddings=architecture != "mamba2",
                      max_position_embeddings=1 << 20, qk_norm=False, residual_in_fp32=True)  # (a float32 stream)
    if architecture == "olmo":  # unscaled LayerNorms; q, k and v clamped to [-0.5, 0.5] (bites at O(1) weights)
        fields.update(clip_qkv=0.5, rms_norm_eps=1e-5)
    if architecture == "stablelm":  # LayerNorms, a quarter of each head rotating, q/k/v biases (stablelm-2-1_6b's)
        fields.update(num_kv_heads=4, rotary_dim=4, attention_bias=True, rms_norm_eps=1e-5)
    if architecture in ("cwm", "ministral"):  # every fourth layer from the first full, the rest sliding
        fields.update(sliding_window=8, layer_types=tuple("full_attention" if i % 4 == 0 else "sliding_attention"
                                                          for i in range(layers)))
    if architecture == "lfm2_moe":
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      router_scoring="sigmoid", router_score_bias=True, moe_layers=tuple(int(i > 0) for i in range(layers)))
    fields.update(overrides)
    return ModelConfig(**fields)


def wide_hybrid_config(num_layers: int = 8, **overrides: Any) -> ModelConfig:
    """A Qwen3.5 of `tiny_config`'s layer pattern whose Gated DeltaNet layers are wide (16 value heads of 32):
    its linear layers' working memory, not its attention's, is most of a program's (what memory probes must see)."""
    from areal_jax.models.config_checks import LinearAttention  # noqa: PLC0415

    linear = LinearAttention(key_heads=4, value_heads=16, key_dim=32, value_dim=32, conv_kernel=4)
    return tiny_config("qwen3_5_text", num_layers=num_layers, vocab_size=256, max_position_embeddings=4096,
                       **overrides).replace(linear=linear)
