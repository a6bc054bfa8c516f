"""Synthetic load for measuring the RL loop at a given model size (benchmarks/loop.py).

- `MODEL_SHAPES` / `shape_config`: the published shapes of Qwen2.5 0.5B / 1.5B / 7B, Gemma 3 1B / 4B (text),
  Phi-4-mini, Granite 3 MoE 1B, gpt-oss-20b, DeepSeek-V2-Lite, Qwen3.5-9B and Ministral-3-8B (text), as ModelConfigs
  for random weights: every benchmark's presets name one;
- `PRESETS`: those shapes (and a tiny one) with the rollout sizes that go with them;
- `long_tail_lengths`: per-request generation lengths, log-normal around a median, capped;
- `ForcedLengths`: wraps a SamplerLoop so each request generates exactly its drawn length (no stop
  token), which is how a random-weight model is made to behave like a reasoning model's long tail;
- `bernoulli_reward`: a reward the pool can run, 1 for about half the completions (a hash of the text),
  so GRPO advantages are non-zero and every update really changes the weights;
- `handoff_latencies`: publish -> weights swapped in -> first token at the new version, from a run's
  timeline.json.
"""
from __future__ import annotations

import dataclasses
import json
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from areal_jax.system.interfaces import RolloutSampler, SampledCompletion

if TYPE_CHECKING:
    from areal_jax.sampler.requests import Request


# The Hugging Face configs of Qwen/Qwen2.5-{0.5B,1.5B,7B} (q/k/v bias, RoPE theta 1e6; the two small ones tie
# their embeddings) and of google/gemma-3-1b-it and the text decoder of gemma-3-4b-it (sliding layers between
# every sixth global one, their own RoPE base, linear RoPE scaling on 4B's global layers).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(architecture="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, tie_word_embeddings=True),
    "qwen2.5-7b": dict(architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, tie_word_embeddings=False),
    "gemma3-1b": dict(architecture="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                      num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, tie_word_embeddings=True,
                      sliding_window=512),
    "gemma3-4b": dict(architecture="gemma3", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                      num_layers=34, num_heads=8, num_kv_heads=4, head_dim=256, tie_word_embeddings=True,
                      sliding_window=1024, rope_scaling={"rope_type": "linear", "factor": 8.0}),
    # microsoft/Phi-4-mini-instruct (and -reasoning): fused q/k/v and gate/up on disk, 3/4 of each head rotates
    # (96 of 128), LongRoPE past 4,096 positions (`shape_config` adds it, with placeholder factor lists).
    "phi4-mini": dict(architecture="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192,
                      num_layers=32, num_heads=24, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    # ibm-granite/granite-3.1-1b-a400m-instruct: a mixture of experts (8 of 32, 1.3B in all, 0.4B active per token)
    # with Granite's scalars.
    "granite3-moe-1b": dict(architecture="granitemoe", vocab_size=49155, hidden_size=1024, intermediate_size=512,
                            num_layers=24, num_heads=16, num_kv_heads=8, head_dim=64, tie_word_embeddings=True,
                            num_experts=32, num_experts_per_tok=8, norm_topk_prob=True, embedding_multiplier=12.0,
                            residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=6.0),
    # openai/gpt-oss-20b: 4 of 32 experts (20.9B in all, 3.6B active per token), attention sinks, every other layer
    # sliding over 128 positions, YaRN (`shape_config` adds the gpt-oss fields).
    "gpt-oss-20b": dict(architecture="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                        num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64, tie_word_embeddings=False,
                        num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, sliding_window=128),
    # deepseek-ai/DeepSeek-V2-Lite: latent attention (16 heads of 128 + 64, latent 512), a dense first layer, then 6 of
    # 64 experts plus 2 shared ones (15.7B in all), YaRN (`shape_config` adds the latent attention and the routing).
    "deepseek-v2-lite": dict(architecture="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                             num_layers=27, num_heads=16, num_kv_heads=16, head_dim=192, tie_word_embeddings=False,
                             num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
                             shared_expert_size=2816),
    # The text decoders of Qwen/Qwen3.5-9B (three Gated DeltaNet layers of 16 key / 32 value heads of 128 to each gated
    # attention layer, 8.95B) and mistralai/Ministral-3-8B-Base-2512 (Mistral's layer, YaRN, queries scaled by
    # position; 8.49B): transformers' Qwen3_5TextConfig and Ministral3Config defaults, which `shape_config` starts from.
    "qwen3.5-9b": dict(architecture="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                       num_layers=32, num_heads=16, num_kv_heads=4, head_dim=256, tie_word_embeddings=False),
    "ministral3-8b": dict(architecture="ministral3", vocab_size=131072, hidden_size=4096, intermediate_size=14336,
                          num_layers=34, num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
    # nvidia/NVIDIA-Nemotron-Nano-9B-v2 (8.89B): 27 Mamba-2 mixers (128 heads of 80, 8 groups of 128), 4 attention
    # layers without position embeddings and 25 squared-ReLU MLPs, in 31 of our layers (`NEMOTRON_NANO_9B`'s blocks)
    "nemotron-nano-9b-v2": dict(architecture="nemotron_h", vocab_size=131072, hidden_size=4480,
                                intermediate_size=15680, num_layers=31, num_heads=40, num_kv_heads=8, head_dim=128,
                                tie_word_embeddings=False),
    # tiiuae/Falcon-H1-0.5B (0.52B): 36 layers of attention (8 query, 2 kv heads of 64) beside a Mamba-2 mixer (24
    # heads of 64, one group of 128 states), its muP multipliers (`FALCON_H1_05B`)
    "falcon-h1-0.5b": dict(architecture="falcon_h1", vocab_size=32784, hidden_size=1024, intermediate_size=2048,
                           num_layers=36, num_heads=8, num_kv_heads=2, head_dim=64, tie_word_embeddings=False),
}
FALCON_H1_05B = {"model_type": "falcon_h1", "mamba_d_ssm": 1536, "mamba_n_heads": 24, "mamba_d_head": 64,
                 "mamba_d_state": 128, "mamba_n_groups": 1, "rope_theta": 1e11, "embedding_multiplier": 5.656854249492381,
                 "lm_head_multiplier": 0.0390625, "key_multiplier": 0.390625, "attention_out_multiplier": 0.9375,
                 "ssm_in_multiplier": 1.25, "ssm_out_multiplier": 0.23570226039551587,
                 "mlp_multipliers": [0.8838834764831844, 0.5859375],
                 "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738]}
NEMOTRON_NANO_9B = {"model_type": "nemotron_h", "mamba_num_heads": 128, "mamba_head_dim": 80, "ssm_state_size": 128,
                    "n_groups": 8, "conv_kernel": 4, "layer_norm_epsilon": 1e-5,
                    "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"}


def shape_config(name: str, *, max_len: int, dtype: str = "bfloat16", param_dtype: str = "float32",
                 **overrides: Any):
    """The ModelConfig of MODEL_SHAPES[name] for random weights (no BOS / EOS: lengths are forced), with
    `overrides` applied (e.g. num_layers; Gemma's layer types follow the layer count)."""
    import jax.numpy as jnp

    from areal_jax.models.config import ModelConfig
    from areal_jax.models.config_checks import MLA

    if name not in MODEL_SHAPES:
        raise ValueError(f"Unknown model shape {name!r}; choose one of {', '.join(MODEL_SHAPES)}.")
    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    architecture = MODEL_SHAPES[name]["architecture"]
    if architecture in ("qwen3_5_text", "ministral3", "nemotron_h", "falcon_h1"):  # the rest as transformers' defaults
        base = ModelConfig.from_hf_dict({"nemotron_h": NEMOTRON_NANO_9B, "falcon_h1": FALCON_H1_05B}.get(  # have it
            architecture, {"model_type": architecture}))
        fields = {**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **MODEL_SHAPES[name],
                  "bos_token_id": None, "eos_token_id": None, "dtype": dtypes[dtype], "param_dtype": dtypes[param_dtype],
                  "max_position_embeddings": max(base.max_position_embeddings, max_len), **overrides}
        if architecture == "qwen3_5_text":  # every fourth layer attention and a quarter of each head rotating,
            fields["layer_types"] = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"  # whatever
                                          for i in range(fields["num_layers"]))  # the layer count and head_dim
            fields["rotary_dim"] = fields["head_dim"] // 8 * 2
        if architecture == "nemotron_h":  # the first num_layers of its layers' kinds (unless the overrides say)
            n = fields["num_layers"]
            fields.update({"layer_types": base.layer_types[:n], "mlp_layers": base.mlp_layers[:n], "rope_layers": (0,) * n,
                           **{k: v for k, v in overrides.items() if k in ("layer_types", "mlp_layers")}})
        if architecture == "falcon_h1":
            fields["layer_types"] = ("hybrid",) * fields["num_layers"]
        return ModelConfig(**fields)
    fields = dict(MODEL_SHAPES[name], rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                  max_position_embeddings=max(32768, max_len), dtype=dtypes[dtype], param_dtype=dtypes[param_dtype])
    if fields["architecture"] == "qwen2":
        fields.update(attention_bias=True, rope_theta=1e6)
    elif fields["architecture"] == "phi3":
        fields.update(max_position_embeddings=max(131072, max_len))
    elif fields["architecture"] == "granitemoe":
        fields.update(rope_theta=1e7)
    elif fields["architecture"] == "gpt_oss":
        fields.update(rope_theta=150000.0, attention_bias=True, attention_out_bias=True, attention_sinks=True,
                      expert_bias=True, swiglu_limit=7.0, max_position_embeddings=max(131072, max_len),
                      rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096})
    elif fields["architecture"] == "deepseek_v2":
        fields.update(mla=MLA(None, 512, 128, 64, 128), shared_expert_gated=False, rope_theta=10000.0,
                      max_position_embeddings=max(163840, max_len), rope_scaling={
                          "rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                          "beta_slow": 1, "original_max_position_embeddings": 4096})
    else:
        fields.update(qk_norm=True, rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=256.0)
    fields.update(overrides)
    if fields["architecture"] == "deepseek_v2":  # a dense first layer, whatever the layer count
        fields.setdefault("moe_layers", tuple(int(i > 0) for i in range(fields["num_layers"])))
    if fields["architecture"] == "phi3":  # 3/4 of head_dim rotates, whatever head_dim the overrides give
        rotary = fields["head_dim"] * 3 // 4 // 2 * 2
        fields.update(rope_theta=10000.0, rotary_dim=rotary, rope_scaling={
            "rope_type": "longrope", "original_max_position_embeddings": 4096, "short_factor": [1.0] * (rotary // 2),
            "long_factor": [1.0 + i / 8 for i in range(rotary // 2)]})
        return ModelConfig(**fields).for_sequence_length(max_len)
    if fields["architecture"] in ("gemma3", "gpt_oss"):
        every = 6 if fields["architecture"] == "gemma3" else 2
        fields["layer_types"] = tuple("sliding_attention" if (i + 1) % every else "full_attention"
                                      for i in range(fields["num_layers"]))
    return ModelConfig(**fields)


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(model=dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=32, tie_word_embeddings=True),
                 dtype="float32", median=24, cap=64, slots=32, group_size=4, batch_groups=4, steps=6),
    "qwen2.5-0.5b": dict(dtype="bfloat16", median=1024, cap=8192, slots=64, group_size=8, batch_groups=8, steps=6),
    "qwen2.5-1.5b": dict(dtype="bfloat16", median=1024, cap=8192, slots=64, group_size=8, batch_groups=8, steps=4),
    "gemma3-1b": dict(dtype="bfloat16", median=1024, cap=8192, slots=64, group_size=8, batch_groups=8, steps=6),
    "qwen2.5-7b": dict(dtype="bfloat16", median=1024, cap=8192, slots=64, group_size=8, batch_groups=8, steps=2),
}


def model_config(preset: str, max_len: int, dtype: str):
    """The ModelConfig of `preset` (float32 params, compute `dtype`, no EOS)."""
    import jax.numpy as jnp

    from areal_jax.models.config import ModelConfig

    if preset not in PRESETS:
        raise ValueError(f"Unknown preset {preset!r}; choose one of {', '.join(PRESETS)}.")
    if preset in MODEL_SHAPES:
        return shape_config(preset, max_len=max_len, dtype=dtype)
    fields = dict(architecture="qwen2", rms_norm_eps=1e-6, attention_bias=True, bos_token_id=None,
                  eos_token_id=None, max_position_embeddings=max(32768, max_len), param_dtype=jnp.float32,
                  dtype={"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype])
    fields.update(PRESETS[preset]["model"])
    return ModelConfig(**fields)


def long_tail_lengths(n: int, median: int, cap: int, *, sigma: float = 1.0, seed: int = 0) -> np.ndarray:
    """[n] int64 generation lengths: log-normal with the given median and log-std `sigma`, clipped to
    [1, cap]. sigma 1 puts the 90th percentile at 3.6x the median and the 99th at 10x."""
    if not 1 <= median <= cap:
        raise ValueError(f"The median length ({median}) must lie in [1, cap={cap}]; lower --median or raise --cap.")
    rng = np.random.default_rng(seed)
    draws = np.exp(np.log(median) + sigma * rng.standard_normal(n))
    return np.clip(np.rint(draws), 1, cap).astype(np.int64)


class ForcedLengths:
    """A RolloutSampler (system.interfaces) for the RolloutController that wraps a SamplerLoop: request
    `id` (the group number) generates exactly `lengths[id % len(lengths)]` tokens per sample, with no
    stop token. Everything else (completions, version, other attributes) is the wrapped loop's."""

    def __init__(self, sampler: RolloutSampler, lengths: np.ndarray):
        self._sampler = sampler
        self._lengths = np.asarray(lengths, np.int64)

    def length_of(self, request_id: int) -> int:
        return int(self._lengths[int(request_id) % len(self._lengths)])

    @property
    def current_version(self) -> int:
        return self._sampler.current_version

    def submit(self, request: Request) -> None:
        self._sampler.submit(dataclasses.replace(request, max_new_tokens=self.length_of(request.id),
                                                 stop_token_ids=()))

    def get_completion(self, timeout: float | None = None) -> SampledCompletion | None:
        return self._sampler.get_completion(timeout)

    def __getattr__(self, name: str) -> object:
        return getattr(self._sampler, name)


def ids_as_text(token_ids: list[int]) -> str:
    """The completion 'text' the reward sees: its token ids (a random model's tokens need no tokenizer)."""
    return ",".join(str(int(t)) for t in token_ids)


def bernoulli_reward(completion: str, answer: str) -> float:
    """1.0 for about half of all completions, decided by a hash of the text (reproducible across
    processes and runs), else 0.0. `answer` is ignored."""
    del answer
    return float(zlib.crc32(completion.encode("utf-8")) & 1)


def _timeline_events(path: str) -> tuple[dict[int, str], list[dict]]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    return lanes, [e for e in events if e.get("ph") == "X"]


def handoff_latencies(timeline_path: str, first_version: int = 0) -> list[dict[str, float]]:
    """Per delivered version v: seconds from the start of the trainer's publish of v to the end of the
    sampler's weight swap ("apply_s") and to the end of the first decode step that started after the
    swap, i.e. the first token sampled from version-v logits ("first_token_s"). Publishes are numbered
    first_version + 1, + 2, ... in order; versions the sampler skipped (a newer one arrived first) or
    never decoded with are left out."""
    lanes, spans = _timeline_events(timeline_path)
    lane_of = {e_id: name for e_id, name in lanes.items()}
    publishes = sorted((e for e in spans if e["name"] == "publish" and lane_of.get(e["tid"]) == "trainer"),
                       key=lambda e: e["ts"])
    start_of = {first_version + i + 1: e["ts"] for i, e in enumerate(publishes)}
    updates = [e for e in spans if e["name"] == "weight_update" and lane_of.get(e["tid"]) == "sampler"]
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in spans
                   if e["name"] == "decode_step" and lane_of.get(e["tid"]) == "sampler")
    starts = np.array([s for s, _ in steps])
    out = []
    for u in sorted(updates, key=lambda e: e["ts"]):
        version = int(u["args"].get("version", -1))
        if version not in start_of:
            continue
        swapped = u["ts"] + u["dur"]
        i = int(np.searchsorted(starts, swapped)) if len(starts) else 0
        if i >= len(steps):
            continue
        out.append({"version": version, "apply_s": (swapped - start_of[version]) / 1e6,
                    "first_token_s": (steps[i][1] - start_of[version]) / 1e6})
    return out


def lane_busy_seconds(timeline_path: str) -> dict[str, dict[str, float]]:
    """Seconds per (lane, span name) in a timeline, overlapping spans of one name counted once."""
    lanes, spans = _timeline_events(timeline_path)
    groups: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for e in spans:
        groups.setdefault((lanes.get(e["tid"], str(e["tid"])), e["name"]), []).append((e["ts"], e["ts"] + e["dur"]))
    out: dict[str, dict[str, float]] = {}
    for (lane, name), intervals in groups.items():
        total, end = 0, -1
        for s, e in sorted(intervals):
            if e > end:
                total += e - max(s, end)
                end = e
        out.setdefault(lane, {})[name] = total / 1e6
    return out
