"""ModelConfig: the hyper-parameters of the decoder (every family of docs/models.md) and HF config.json I/O."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from areal_jax.models import config_checks as checks
from areal_jax.models.layer_form import LayerForm

MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "granitemoe", "granitemoeshared", "granitemoe_swa", "olmoe", "qwen2_moe", "gpt_oss", "deepseek_v2", "deepseek_v3", "glm4_moe", "dots1",
                     "glm4_moe_lite", "minimax_m2", "ernie4_5_moe", "qwen3_5_moe_text", "qwen3_next", "exaone_moe", "hunyuan_v1_moe",
                     "phimoe", "flex_olmo", "lfm2_moe")
ARCHITECTURES = ("qwen2", "qwen3", "llama", "internlm3", "mistral", "gemma2", "gemma3", "olmo2", "olmo3", "smollm3", "phi3", "granite", "granite_swa",
                 "ernie4_5", "glm4", "exaone4", "hunyuan_v1_dense", "seed_oss", "arcee", "qwen3_5_text", "ministral3",
                 "lfm2", "lfm3", "olmo_hybrid", "granitemoehybrid", "bamba", "nemotron_h", "falcon_h1", "jamba", "mamba",
                 "falcon_mamba", "mamba2", "cwm", "youtu", "cohere", "cohere2", "starcoder2", "gpt_neox", "phi", "gemma", "glm", "helium", "ministral", "apertus", "stablelm", "exaone", "olmo", "jais2", "nemotron",
                 "nanochat", *MOE_ARCHITECTURES)
MOE_IMPLS, EXPERT_DISPATCHES = ("auto", "blocked", "dense", "ragged", "pallas"), ("auto", "gather", "ring")
_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional", "dynamic")
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "conv", "hybrid")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _dtype_name(dt: np.dtype) -> str:
    return jnp.dtype(dt).name


@dataclasses.dataclass(frozen=True)
class ModelConfig(LayerForm):
    """Hyper-parameters of one decoder-only transformer.

    architecture: the HF model type whose layer this is (one of `ARCHITECTURES`; docs/models.md says what each
      one's layer does otherwise than Llama's). What the code asks of it goes through the properties below (`gemma`,
      `norm_offset`, `olmo`, `sandwich_norms`, `flat_qk_norm`, `gated_attention`, `layer_norm`) and the fields; a
      family with a module of its own (`families.OWN_MODULES`) reads and writes its config.json there.
    rope_scaling: None, or an HF-style dict such as {"rope_type": "llama3", "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, YaRN's
      {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768} (Qwen2.5 / Qwen3 long
      context), {"rope_type": "linear", "factor": 8.0} (positions divided by the factor), or Phi's
      {"rope_type": "longrope", "short_factor": [...], "long_factor": [...], "original_max_position_embeddings":
      4096} (each frequency divided by its factor; the long factors where "use_long_factor": `for_sequence_length`),
      or dynamic NTK scaling {"rope_type": "dynamic", "factor": 6.0} (InternLM3's: the default frequencies up to
      max_position_embeddings, the only lengths a run may take here: `for_sequence_length`).
    sliding_window: a sliding layer's query at position p attends keys at positions p - sliding_window + 1 .. p
      (HF's convention: the last `sliding_window` tokens, itself included).
    layer_types: per layer "full_attention", "sliding_attention" (None: all sliding when sliding_window is set) or
      "linear_attention" (a Gated DeltaNet layer of `linear`'s shapes: models.gated_deltanet) or "conv" (LFM2's gated
      short convolution of `short_conv` taps: models.short_conv).
    rope_local_theta: the RoPE base of sliding layers, which then take no rope_scaling (Gemma 3's
      rope_local_base_freq); None: every layer uses rope_theta and rope_scaling.
    query_pre_attn_scalar: attention scores are scaled by query_pre_attn_scalar ** -0.5 (None: head_dim).
    rope_layers: per layer 1 (rotary embeddings) or 0 (none: SmolLM3's NoPE layers); None: every layer rotates.
    rotary_dim: the leading dimensions of each head that rotate (Phi's partial_rotary_factor; the rest pass
      through); None: all head_dim. rope_interleave: they rotate as pairs (x0, x1), (x2, x3), ... (ERNIE 4.5), not halves.
    attn_logit_softcap, final_logit_softcap: Gemma 2's tanh soft-capping, c * tanh(x / c), of the attention
      scores (after scaling, before the mask) and of the output logits; None: none.
    attention_bias: whether q/k/v projections carry a bias (Qwen2 always does); attention_out_bias: o_proj too;
      mlp_bias: the dense MLPs' projections (StarCoder2's). residual_in_fp32: the residual stream between layers is
      float32 whatever the compute dtype (each block's norm takes it rounded to the compute dtype, its output is added
      in float32: Mamba's, Falcon-Mamba's, Mamba-2's; needs layers without a feed-forward). clip_qkv: q, k and v clamped to [-clip_qkv, clip_qkv] right
      after their projections (OLMo's), or None.
    attention_sinks: each attention head has a learned logit `sinks` [H] that joins every query's softmax as one
      more key whose value is zero (gpt-oss): the weights of the real keys then sum to less than 1.
    expert_bias: the router and every expert's gate, up and down products carry biases (gpt-oss).
    swiglu_limit, swiglu_alpha: gpt-oss's expert activation: gate clamped to <= limit, up to [-limit, limit], and
      (up + 1) * gate * sigmoid(alpha * gate) instead of silu(gate) * up; None: SwiGLU.
    qk_norm: RMSNorm over head_dim on queries and keys before RoPE (Qwen3). head_gate: each head's attention output
      times sigmoid(x . g_proj) of the layer's input (LFM3's g_proj [D, H]).
    embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling: Granite's scalars: the
      embeddings are multiplied by the first, each attention and MLP output by the second before it is added to the
      residual stream, attention scores are q.k times the third (instead of head_dim ** -0.5), and the logits are
      divided by the fourth; None: not applied.
    num_experts, num_experts_per_tok: a mixture-of-experts feed-forward (models.moe) of num_experts gated MLPs of
      width moe_intermediate_size (None: intermediate_size), each token sent to its top num_experts_per_tok by a
      softmax router (norm_topk_prob: their weights renormalised to sum to 1); 0 experts: a dense MLP everywhere.
    shared_expert_size: the width of Qwen2-MoE's shared expert, a gated MLP every token goes through besides its
      routed experts, its output scaled by sigmoid(x . shared_expert_gate); None: none.
    router_scoring, router_groups, router_score_bias, routed_scaling_factor: DeepSeek's router: "sigmoid"
      scores (else "softmax"); the top k picked among the experts of the best topk_group of n_group groups
      (router_groups=(n_group, topk_group), a group ranked by the sum of its two best scores with sigmoid scores, by
      its best with softmax ones: `routing.Scoring`); a per-expert bias
      `router_score_bias` [E] added to the scores for picking only (never trained: no gradient reaches it); the
      weights (the picked scores, renormalised with norm_topk_prob) times routed_scaling_factor. "sparsemixer":
      PhiMoE's picks and weights (`routing.sparsemixer`), router_jitter its relative margin. lm_head_bias: a bias on
      the output logits (PhiMoE).
    shared_expert_gated: False: the shared expert's output is added as it is (DeepSeek's shared experts).
    mla: None, or `MLA` shapes: multi-head latent attention (models.mla; head_dim is then nope + rope). linear: None,
      or `LinearAttention` shapes: the "linear_attention" layers' Gated DeltaNet; mamba: or `Mamba2` shapes: theirs
      are Mamba-2 mixers (models.mamba2); mamba1: or `Mamba1` shapes: Mamba mixers (Jamba's); a "hybrid" layer has attention and that Mamba-2 mixer side by side
      (Falcon-H1), with `hybrid_scales` (a `HybridScales`: Falcon-H1's multipliers; None: all 1).
    moe_layers: per layer 1 (experts) or 0 (a dense MLP of intermediate_size: Qwen3-MoE's mlp_only_layers);
      None: every layer has experts when num_experts > 0. mlp_layers: per layer 1 (a feed-forward) or 0 (none: the
      layer is its token mixer alone, Nemotron-H's mixer followed by another); None: every layer has one.
    moe_impl: how the experts compute (not a property of the checkpoint): "blocked", "ragged", "pallas" or "dense"
      (models.moe); "auto": ragged on TPU, dense on GPUs for a decode step's few hundred tokens
      (`expert_paths.resolve_moe_impl`), blocked elsewhere. All are dropless: a token's output does not depend on the batch.
    expert_parallel: under a mesh whose fsdp axis the expert count divides, each device keeps E / fsdp whole experts
      and the tokens go to them (models.expert_parallel); False: FSDP gathers every expert's weights. expert_dispatch:
      "gather" (all-gather every device's rows), "ring" (pass them round the fsdp ring: memory flat in its size) or
      "auto" (gather; a job's memory plan takes ring where only it fits: `system.memory.JobMemory.resolve_update`).
    dtype: compute dtype (activations, KV cache); param_dtype: storage dtype of the parameters.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    rope_layers: tuple[int, ...] | None = None
    rotary_dim: int | None = None
    rope_interleave: bool = False
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    attention_multiplier: float | None = None
    logits_scaling: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    shared_expert_size: int | None = None
    moe_layers: tuple[int, ...] | None = None
    mlp_layers: tuple[int, ...] | None = None
    moe_impl: str = "auto"
    expert_parallel: bool = True
    expert_dispatch: str = "auto"
    attention_out_bias: bool = False
    mlp_bias: bool = False
    residual_in_fp32: bool = False
    clip_qkv: float | None = None
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    router_scoring: str = "softmax"
    router_groups: tuple[int, int] | None = None
    router_score_bias: bool = False
    routed_scaling_factor: float = 1.0
    router_jitter: float = 0.01
    lm_head_bias: bool = False
    shared_expert_gated: bool = True
    mla: checks.MLA | None = None
    linear: checks.LinearAttention | None = None
    short_conv: int | None = None
    mamba: checks.Mamba2 | None = None
    mamba1: checks.Mamba1 | None = None
    hybrid_scales: checks.HybridScales | None = None
    head_gate: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"Unknown architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}.")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads}) for grouped-query attention.")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}.")
        checks.check_rotary(self)
        for name in ("attn_logit_softcap", "final_logit_softcap", "embedding_multiplier", "residual_multiplier",
                     "attention_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float, np.floating)) and value > 0):
                raise ValueError(f"ModelConfig.{name} must be a positive number or None, got {value!r}.")
        object.__setattr__(self, "dtype", checks.to_dtype(self.dtype, "dtype"))
        object.__setattr__(self, "param_dtype", checks.to_dtype(self.param_dtype, "param_dtype"))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        checks.check_attention_layout(self, LAYER_TYPES)
        for check in (checks.check_experts, checks.check_gated_experts, checks.check_routing, checks.check_mla,
                      checks.check_linear, checks.check_head_gate, checks.check_residual):
            check(self)
        checks.check_rope_scaling(self)

    @property
    def rope_dim(self) -> int:
        """The dimensions of a head that rotate (`rotary_dim`, latent attention's rope width, else head_dim)."""
        return self.mla.rope if self.mla is not None else self.rotary_dim or self.head_dim

    def for_sequence_length(self, length: int) -> "ModelConfig":
        """This config for sequences of up to `length` tokens: with LongRoPE, its long factors when `length`
        exceeds original_max_position_embeddings, else its short ones (transformers picks per forward call by
        the call's longest position; one choice per run keeps the sampler and the trainer on the same
        positions). Dynamic NTK scaling changes the frequencies with each call's length past max_position_embeddings (in
        transformers, even for keys cached before), so longer runs are refused. Other configs are returned as they are."""
        s = self.rope_scaling
        if s is not None and s.get("rope_type") == "dynamic" and int(length) > self.max_position_embeddings:
            raise ValueError(f"rope_scaling {s} (dynamic NTK scaling) keeps the default RoPE up to "
                             f"max_position_embeddings={self.max_position_embeddings} and changes it with each call's "
                             f"length past that, which is not supported here; keep sequences (rollout.max_len) to "
                             f"{self.max_position_embeddings} tokens or fewer (asked for {int(length)}).")
        if s is None or s.get("rope_type") != "longrope":
            return self
        use_long = int(length) > int(s["original_max_position_embeddings"])
        return self if use_long == s["use_long_factor"] else self.replace(rope_scaling={**s, "use_long_factor": use_long})

    def __hash__(self) -> int:
        values = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            values.append(tuple(sorted(v.items())) if isinstance(v, dict) else v)
        return hash(tuple(values))

    def layer_is_moe(self, i: int) -> bool:
        """Whether layer i's feed-forward is a mixture of experts (else a dense MLP of intermediate_size, or none)."""
        return self.num_experts > 0 and (self.moe_layers is None or bool(self.moe_layers[i])) and self.layer_has_mlp(i)

    def layer_has_mlp(self, i: int) -> bool:
        """Whether layer i has a feed-forward (and the norm before it) after its token mixer (`mlp_layers`)."""
        return self.mlp_layers is None or bool(self.mlp_layers[i])

    @property
    def expert_size(self) -> int:
        """The hidden width of one expert (moe_intermediate_size, else intermediate_size)."""
        return int(self.moe_intermediate_size or self.intermediate_size)

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i (None: full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[i] == "sliding_attention":
            return int(self.sliding_window)
        return None

    def layer_rope(self, i: int) -> str:
        """Which RoPE table layer i reads: "none" (no rotation: `rope_layers`), "local" (a sliding layer with its
        own base, rope_local_theta) or "global"."""
        if self.rope_layers is not None and not self.rope_layers[i]:
            return "none"
        return "local" if self.rope_local_theta is not None and self.layer_window(i) is not None else "global"

    def layer_is_linear(self, i: int) -> bool:
        """Whether layer i keeps a fixed state per row in place of keys and values: Gated DeltaNet (`linear`), Mamba-2
        (`mamba`) or a short convolution (`short_conv`), rather than attention."""
        return self.layer_types is not None and self.layer_types[i] in ("linear_attention", "conv")

    def layer_is_hybrid(self, i: int) -> bool:
        """Whether layer i has attention and the stateful mixer side by side (Falcon-H1): its keys and values in cache
        entry i, its window and state in entry `state_entry(i)`."""
        return self.layer_types is not None and self.layer_types[i] == "hybrid"

    def state_entry(self, i: int) -> int:
        """The cache entry of stateful layer i's window and state: i itself (`layer_is_linear`), or past the layers'
        entries in order for the hybrid layers (`cache_entries`)."""
        return i if not self.layer_is_hybrid(i) else self.num_layers + self.layer_types[:i].count("hybrid")

    @property
    def cache_entries(self) -> int:
        """Entries of a cache: one per layer, then one per hybrid layer (its mixer's window and state)."""
        return self.num_layers + (self.layer_types or ()).count("hybrid")

    @property
    def recurrent(self) -> bool:
        """Whether some layers keep a state per row (`layer_is_linear`) that a padding token must not advance."""
        return any(x is not None for x in (self.linear, self.short_conv, self.mamba, self.mamba1))

    @property
    def attention_scale_factor(self) -> float:
        """What queries are multiplied by so that the attention paths' 1 / sqrt(head_dim) gives
        query_pre_attn_scalar ** -0.5, or Granite's attention_multiplier (1.0 when neither is set, or the scalar
        equals head_dim); with latent attention YaRN's mscale_all_dim squared (`mla_query_factor`)."""
        if self.mla is not None:
            return checks.mla_query_factor(self)
        if self.attention_multiplier is not None:
            return float(self.attention_multiplier) * math.sqrt(self.head_dim)
        if self.hybrid_scales is not None:  # Falcon-H1's key_multiplier (on the keys: the same scores)
            return float(self.hybrid_scales.key)
        if self.query_pre_attn_scalar is None or float(self.query_pre_attn_scalar) == float(self.head_dim):
            return 1.0
        return math.sqrt(self.head_dim / float(self.query_pre_attn_scalar))

    def with_layers(self, n: int, linear: bool = False) -> ModelConfig:
        """This model with `n` decoder layers of full attention (a window needs no more memory) or, with linear, of
        its stateful kind (Gated DeltaNet, short convolutions, Falcon-H1's hybrid layers): what memory probes compile
        and extrapolate from (a hybrid's kinds apart). Experts: probed."""
        moe = None if self.moe_layers is None else (1,) * n  # expert layers cost the most memory: probe those
        kind = "conv" if self.short_conv is not None else "hybrid" if "hybrid" in (self.layer_types or ()) else \
            "linear_attention"
        return self.replace(num_layers=n, layer_types=(kind,) * n if linear else None, sliding_window=None,
                            moe_layers=moe, mlp_layers=None, linear=self.linear if linear else None,
                            short_conv=self.short_conv if linear else None, mamba=self.mamba if linear else None,
                            mamba1=self.mamba1 if linear else None)

    def replace(self, **kwargs: Any) -> ModelConfig:
        """Returns a copy with the given fields changed (validated again)."""
        return dataclasses.replace(self, **kwargs)

    @property
    def num_params(self) -> int:
        """Total number of parameters (embedding counted once when tied; models.param_counts)."""
        from areal_jax.models.param_counts import num_params

        return num_params(self)

    @property
    def matmul_params_per_token(self) -> int:
        """The weights one token multiplies through in the decoder layers (its active ones in a mixture of experts;
        models.param_counts)."""
        from areal_jax.models.param_counts import matmul_params_per_token

        return matmul_params_per_token(self)

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, d: dict, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32) -> ModelConfig:
        """Builds a config from the contents of an HF config.json (old or new rope layout; models.hf_config)."""
        from areal_jax.models.hf_config import config_from_hf

        return config_from_hf(cls, d, dtype=dtype, param_dtype=param_dtype)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: Any = jnp.float32,
                        param_dtype: Any = jnp.float32) -> ModelConfig:
        """Reads `<path>/config.json` (an HF checkpoint directory; models.hf_config)."""
        from areal_jax.models.hf_config import read_config_json

        return cls.from_hf_dict(read_config_json(path), dtype=dtype, param_dtype=param_dtype)

    def to_hf_dict(self) -> dict:
        """A config.json dictionary that transformers loads as the matching *ForCausalLM model (models.hf_config)."""
        from areal_jax.models.hf_config import config_to_hf

        return config_to_hf(self)

def model_config_of(model: Any, *, required: bool = True) -> ModelConfig | None:
    """The ModelConfig a Transformer carries (as `config` or `cfg`). Without one: a TypeError, or None
    when not `required`."""
    for name in ("config", "cfg"):
        cfg = getattr(model, name, None)
        if isinstance(cfg, ModelConfig):
            return cfg
    if not required:
        return None
    raise TypeError(
        "Could not find the ModelConfig on the model (expected a `config` or `cfg` attribute); pass a "
        "Transformer, or a graphdef together with config=..."
    )
