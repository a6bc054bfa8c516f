"""ModelConfig: the hyper-parameters of the decoder family (Qwen2, Qwen3, Llama, Mistral, Gemma 3, OLMo 2 / 3) and
HF config.json I/O."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

ARCHITECTURES = ("qwen2", "qwen3", "llama", "mistral", "gemma3", "olmo2", "olmo3", "smollm3")
_HF_CLASS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
             "mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
             "olmo3": "Olmo3ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
_HF_MODEL_TYPE = {"gemma3": "gemma3_text"}  # architecture -> HF model_type where the two differ
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' Gemma3TextConfig defaults: the hub's image-and-text checkpoints (4B, 12B, 27B) list only the keys of
# their text_config that differ from these.
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "bos_token_id": 2,
    "eos_token_id": 1}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _to_dtype(value: Any, field: str) -> np.dtype:
    try:
        dt = jnp.dtype(value)
    except TypeError as err:
        raise ValueError(f"ModelConfig.{field}={value!r} is not a dtype; use jnp.float32 or jnp.bfloat16.") from err
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"ModelConfig.{field}={dt} is not supported; use float32, bfloat16 or float16.")
    return dt


def _dtype_name(dt: np.dtype) -> str:
    return jnp.dtype(dt).name


def _hf_attention_layout(d: dict, model_type: str, num_layers: int,
                         max_pos: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) of an HF config, as its model class applies them: Mistral slides every
    layer when sliding_window is set; Qwen2 / Qwen3 slide the layers `layer_types` names (by default those from
    max_window_layers on) when use_sliding_window is set; Gemma 3 slides all but every sliding_window_pattern-th
    layer, OLMo 3 all but every fourth. Outside Gemma and OLMo 3 (whose layer types also pick each layer's RoPE),
    a window at least as long as the model's context is dropped (it would change nothing)."""
    if model_type in ("llama", "olmo2"):
        return None, None
    window = d.get("sliding_window")
    if model_type == "mistral":
        types = None
    elif model_type in ("qwen2", "qwen3", "smollm3"):
        if not d.get("use_sliding_window"):
            return None, None
        types = d.get("layer_types") or [
            "sliding_attention" if i >= int(d.get("max_window_layers", 28)) else "full_attention"
            for i in range(num_layers)]
    else:  # gemma3, olmo3
        window = d.get("sliding_window", 4096)
        pattern = int(d.get("sliding_window_pattern", 6)) if model_type == "gemma3" else 4
        types = d.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    types = tuple(types) if types is not None else None
    if model_type in ("gemma3", "olmo3"):  # their layer types also choose each layer's RoPE: kept whatever the window
        return int(window or max_pos), types
    if window is None or int(window) >= max_pos:
        return None, None
    if types is not None and "sliding_attention" not in types:
        return None, None
    return int(window), types


def _hf_rope_layers(d: dict, model_type: str, num_layers: int) -> tuple[int, ...] | None:
    """SmolLM3's per-layer RoPE flags (no_rope_layers: 1 rotates, 0 does not; by default every
    no_rope_layer_interval-th layer does not); None for the other families (every layer rotates)."""
    if model_type != "smollm3":
        return None
    flags = d.get("no_rope_layers") or [int((i + 1) % int(d.get("no_rope_layer_interval", 4)) != 0)
                                         for i in range(num_layers)]
    return None if all(flags) else tuple(int(x) for x in flags)


def _hf_rope(d: dict, model_type: str) -> tuple[dict, float | None]:
    """(the global layers' rope parameters, the sliding layers' own rope base or None) of an HF config: a flat
    rope_parameters / rope_scaling, or Gemma 3's / OLMo 3's per-layer-type dictionary (their sliding layers take
    the default RoPE of their own base: Gemma's rope_local_base_freq, OLMo 3's rope_theta without the global
    layers' scaling)."""
    params = dict(d.get("rope_parameters") or {})
    local = None
    if model_type in ("gemma3", "olmo3"):
        if "full_attention" in params or "sliding_attention" in params:
            local_params = dict(params.get("sliding_attention") or {})
            params = dict(params.get("full_attention") or {})
            if local_params.get("rope_type", "default") != "default":
                raise ValueError(f"The sliding layers have rope {local_params}; only the default RoPE is supported "
                                 "there.")
            local = local_params.get("rope_theta")
        fallback = d.get("rope_local_base_freq", 10000.0) if model_type == "gemma3" else \
            params.get("rope_theta", d.get("rope_theta", 500_000.0))
        local = float(local if local is not None else fallback)
    if d.get("rope_scaling"):
        params.update(d["rope_scaling"])
    return params, local


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one decoder-only transformer.

    architecture: "qwen2" (q/k/v bias), "qwen3" (q/k RMSNorm), "llama" (optionally llama3 RoPE scaling),
      "mistral", or "gemma3" (Gemma 3 text: RMSNorms scaling by 1 + w, a norm after attention and around the
      MLP as well, GELU-tanh MLP, embeddings times sqrt(hidden_size), q/k norm), or "olmo2" / "olmo3" (norms on
      the attention's and the MLP's outputs only, none before them; q/k norm over all heads together; OLMo 3
      also slides a window over three layers of every four).
    rope_scaling: None, or an HF-style dict such as {"rope_type": "llama3", "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, YaRN's
      {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768} (Qwen2.5 / Qwen3 long
      context), or {"rope_type": "linear", "factor": 8.0} (positions divided by the factor).
    sliding_window: a sliding layer's query at position p attends keys at positions p - sliding_window + 1 .. p
      (HF's convention: the last `sliding_window` tokens, itself included).
    layer_types: per layer "full_attention" or "sliding_attention" (None: every layer sliding when
      sliding_window is set, else every layer full).
    rope_local_theta: the RoPE base of sliding layers, which then take no rope_scaling (Gemma 3's
      rope_local_base_freq); None: every layer uses rope_theta and rope_scaling.
    query_pre_attn_scalar: attention scores are scaled by query_pre_attn_scalar ** -0.5 (None: head_dim).
    rope_layers: per layer 1 (rotary embeddings) or 0 (none: SmolLM3's NoPE layers); None: every layer rotates.
    attention_bias: whether q/k/v projections carry a bias (Qwen2 always does).
    qk_norm: RMSNorm over head_dim on queries and keys before RoPE (Qwen3).
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
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"Unknown architecture {self.architecture!r}; supported architectures are {', '.join(ARCHITECTURES)}.")
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
        object.__setattr__(self, "dtype", _to_dtype(self.dtype, "dtype"))
        object.__setattr__(self, "param_dtype", _to_dtype(self.param_dtype, "param_dtype"))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self._check_attention_layout()
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in _ROPE_TYPES:
                raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported types are "
                                 f"{', '.join(_ROPE_TYPES)} (or rope_scaling=None).")
            if rope_type == "linear" and not float(scaling.get("factor") or 0) > 0:
                raise ValueError(f"rope_scaling of type 'linear' needs a positive factor; got {scaling}.")
            if rope_type == "llama3":
                missing = [k for k in _LLAMA3_KEYS if k not in scaling]
                if missing:
                    raise ValueError(f"rope_scaling of type 'llama3' needs keys {', '.join(missing)}; got {scaling}.")
            if rope_type == "yarn":
                if scaling.get("original_max_position_embeddings") is None:  # as transformers: the model's own
                    scaling["original_max_position_embeddings"] = self.max_position_embeddings
                if scaling.get("factor") is None:
                    scaling["factor"] = self.max_position_embeddings / scaling["original_max_position_embeddings"]
                if not float(scaling["factor"]) > 0:
                    raise ValueError(f"rope_scaling of type 'yarn' needs a positive factor; got {scaling}.")
            scaling.pop("type", None)
            scaling["rope_type"] = rope_type
            object.__setattr__(self, "rope_scaling", None if rope_type == "default" else scaling)

    def __hash__(self) -> int:
        values = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            values.append(tuple(sorted(v.items())) if isinstance(v, dict) else v)
        return hash(tuple(values))

    def _check_attention_layout(self) -> None:
        window, types = self.sliding_window, self.layer_types
        if window is not None and (not isinstance(window, (int, np.integer)) or isinstance(window, bool)
                                   or window < 1):
            raise ValueError(f"ModelConfig.sliding_window must be a positive integer or None, got {window!r}.")
        if types is not None:
            types = tuple(types)
            object.__setattr__(self, "layer_types", types)
            if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
                raise ValueError(f"ModelConfig.layer_types must hold num_layers={self.num_layers} entries, each one of "
                                 f"{', '.join(LAYER_TYPES)}; got {list(types)}.")
            if "sliding_attention" in types and window is None:
                raise ValueError("ModelConfig.layer_types has sliding_attention layers but sliding_window is None; "
                                 "set the window (positions each query looks back over).")
        if self.rope_layers is not None:
            flags = tuple(int(x) for x in self.rope_layers)
            object.__setattr__(self, "rope_layers", flags)
            if len(flags) != self.num_layers or any(x not in (0, 1) for x in flags):
                raise ValueError(f"ModelConfig.rope_layers must hold num_layers={self.num_layers} flags, each 1 "
                                 f"(rotary embeddings) or 0 (none); got {list(flags)}.")
        if self.query_pre_attn_scalar is not None and not float(self.query_pre_attn_scalar) > 0:
            raise ValueError(f"ModelConfig.query_pre_attn_scalar must be positive, got {self.query_pre_attn_scalar}.")
        if self.rope_local_theta is not None and not float(self.rope_local_theta) > 0:
            raise ValueError(f"ModelConfig.rope_local_theta must be positive, got {self.rope_local_theta}.")

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

    @property
    def gemma(self) -> bool:
        """Gemma's layer form: norms scale by 1 + w (stored as w), a norm on the attention output and around the
        MLP, a GELU-tanh MLP, embeddings times sqrt(hidden_size)."""
        return self.architecture == "gemma3"

    @property
    def olmo(self) -> bool:
        """OLMo 2 / 3's layer form: x + norm(attn(x)), then x + norm(mlp(x)) (no norm before either), and q/k
        norms over the whole projection (all heads together) rather than per head."""
        return self.architecture in ("olmo2", "olmo3")

    @property
    def attention_scale_factor(self) -> float:
        """What queries are multiplied by so that the attention paths' 1 / sqrt(head_dim) gives
        query_pre_attn_scalar ** -0.5 (1.0 when it is unset or equals head_dim)."""
        if self.query_pre_attn_scalar is None or float(self.query_pre_attn_scalar) == float(self.head_dim):
            return 1.0
        return math.sqrt(self.head_dim / float(self.query_pre_attn_scalar))

    def with_layers(self, n: int) -> ModelConfig:
        """This model with `n` decoder layers, all of full attention: what memory probes compile and extrapolate
        from (a sliding window never needs more memory than full attention, so they bound the real model)."""
        return self.replace(num_layers=n, layer_types=None, sliding_window=None)

    def replace(self, **kwargs: Any) -> ModelConfig:
        """Returns a copy with the given fields changed (validated again)."""
        return dataclasses.replace(self, **kwargs)

    @property
    def num_params(self) -> int:
        """Total number of parameters (embedding counted once when tied)."""
        d, f, h, k, hd = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * h * hd * 2 + d * k * hd * 2 + (h * hd + 2 * k * hd if self.attention_bias else 0)
        attn += ((h + k) * hd if self.olmo else 2 * hd) if self.qk_norm else 0
        layer = attn + 3 * d * f + (4 if self.gemma else 2) * d
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + d

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, d: dict, *, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32) -> ModelConfig:
        """Builds a config from the contents of an HF config.json (old or new rope layout)."""
        model_type = d.get("model_type")
        if model_type is None:
            archs = d.get("architectures") or []
            inverse = {v: k for k, v in _HF_CLASS.items()}
            model_type = next((inverse[a] for a in archs if a in inverse), None)
        if model_type == "gemma3":  # the image-and-text model (4B and up): its text decoder, under text_config
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ValueError("model_type='gemma3' (Gemma3ForConditionalGeneration) needs a text_config dictionary "
                                 "describing its text decoder; this config.json has none.")
            outer = {k: d[k] for k in ("bos_token_id", "eos_token_id") if d.get(k) is not None}
            return cls.from_hf_dict({**outer, **text, "model_type": "gemma3_text"}, dtype=dtype, param_dtype=param_dtype)
        model_type = {v: k for k, v in _HF_MODEL_TYPE.items()}.get(model_type, model_type)
        if model_type == "gemma3":  # keys a Gemma 3 config.json leaves out take transformers' defaults
            d = {**_GEMMA3_TEXT_DEFAULTS, **d}
        if model_type not in ARCHITECTURES:
            raise ValueError(f"Unknown architecture: model_type={d.get('model_type')!r}, architectures="
                             f"{d.get('architectures')!r}; supported model types are "
                             f"{', '.join(_HF_MODEL_TYPE.get(a, a) for a in ARCHITECTURES)}.")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"HF config for {model_type} lacks required keys {', '.join(missing)}.")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported (the MLP projections here have no bias).")
        gemma = model_type == "gemma3"
        act = d.get("hidden_activation") or d.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        wanted_act = "gelu_pytorch_tanh" if gemma else "silu"
        if act != wanted_act:
            raise ValueError(f"hidden activation {act!r} is not supported for {model_type}; only {wanted_act!r} is.")
        if gemma:
            for key in ("attn_logit_softcapping", "final_logit_softcapping"):
                if d.get(key) is not None:
                    raise ValueError(f"{key}={d[key]} (Gemma 2's tanh soft-capping) is not supported; Gemma 3 "
                                     "checkpoints have it null.")
            if d.get("use_bidirectional_attention"):
                raise ValueError("use_bidirectional_attention=True (an encoder) is not supported; a decoder is "
                                 "causal.")
        if model_type == "qwen2":
            attention_bias = True
        else:
            if d.get("attention_bias"):
                raise ValueError(f"attention_bias=True for {model_type} also adds an o_proj bias, which is not "
                                 "supported.")
            attention_bias = False
        num_layers = d["num_hidden_layers"]
        max_pos = int(d.get("max_position_embeddings", 4096))
        window, layer_types = _hf_attention_layout(d, model_type, num_layers, max_pos)
        rope, local_theta = _hf_rope(d, model_type)
        default_theta = {"gemma3": 1_000_000.0, "olmo3": 500_000.0}.get(model_type, 10000.0)
        theta = rope.pop("rope_theta", d.get("rope_theta", default_theta))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported.")
        rope.pop("partial_rotary_factor", None)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        return cls(
            architecture=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else rope,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", gemma)),
            attention_bias=attention_bias,
            qk_norm=model_type in ("qwen3", "gemma3", "olmo2", "olmo3"),
            max_position_embeddings=max_pos,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            sliding_window=window,
            layer_types=layer_types,
            rope_local_theta=local_theta,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)) if gemma else None,
            rope_layers=_hf_rope_layers(d, model_type, num_layers),
            dtype=dtype,
            param_dtype=param_dtype,
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: Any = jnp.float32,
                        param_dtype: Any = jnp.float32) -> ModelConfig:
        """Reads `<path>/config.json` (an HF checkpoint directory)."""
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"Checkpoint directory {path!r} does not exist; pass the folder that holds "
                                    "config.json and the *.safetensors files.")
        file = os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file!r} is missing; an HF checkpoint directory needs a config.json.")
        with open(file) as fh:
            try:
                d = json.load(fh)
            except json.JSONDecodeError as err:
                raise ValueError(f"{file!r} is not valid JSON: {err}.") from err
        return cls.from_hf_dict(d, dtype=dtype, param_dtype=param_dtype)

    def to_hf_dict(self) -> dict:
        """A config.json dictionary that transformers loads as the matching *ForCausalLM model."""
        if self.architecture == "qwen2" and (not self.attention_bias or self.qk_norm):
            raise ValueError("HF Qwen2 always has q/k/v bias and no q/k norm; set attention_bias=True, qk_norm=False "
                             "or choose another architecture.")
        if self.architecture == "qwen3" and (self.attention_bias or not self.qk_norm):
            raise ValueError("HF Qwen3 has q/k norm and no q/k/v-only bias; set qk_norm=True, attention_bias=False.")
        if self.architecture in ("llama", "mistral", "smollm3") and (self.attention_bias or self.qk_norm):
            raise ValueError(f"HF {self.architecture.title()} has no q/k/v bias and no q/k norm; set "
                             "attention_bias=False, qk_norm=False.")
        if (self.gemma or self.olmo) and (self.attention_bias or not self.qk_norm):
            raise ValueError(f"HF {self.architecture} has q/k norm and no q/k/v bias; set qk_norm=True, "
                             "attention_bias=False.")
        sliding = any(self.layer_window(i) is not None for i in range(self.num_layers))
        if sliding and self.architecture in ("llama", "olmo2"):
            raise ValueError(f"HF {self.architecture.title()} has no sliding-window attention; set "
                             "sliding_window=None or choose mistral, qwen2, qwen3, gemma3 or olmo3.")
        if sliding and self.architecture == "mistral" and self.layer_types is not None \
                and "full_attention" in self.layer_types:
            raise ValueError("HF Mistral slides every layer or none; set layer_types=None.")
        if self.rope_local_theta is not None and self.architecture not in ("gemma3", "olmo3"):
            raise ValueError(f"rope_local_theta (a RoPE base of its own for sliding layers) is Gemma 3's and OLMo "
                             f"3's; HF {self.architecture} has one base for every layer.")
        if self.rope_layers is not None and self.architecture != "smollm3":
            raise ValueError(f"rope_layers (layers without rotary embeddings) is SmolLM3's; HF {self.architecture} "
                             "rotates in every layer.")
        if self.query_pre_attn_scalar is not None and not self.gemma:
            raise ValueError(f"query_pre_attn_scalar is Gemma 3's; HF {self.architecture} scales attention by "
                             "head_dim ** -0.5.")
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling)
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        types = [("sliding_attention" if self.layer_window(i) is not None else "full_attention")
                 for i in range(self.num_layers)]
        d = {
            "architectures": [_HF_CLASS[self.architecture]],
            "model_type": _HF_MODEL_TYPE.get(self.architecture, self.architecture),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "gelu_pytorch_tanh" if self.gemma else "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
            "use_cache": True,
            "dtype": _dtype_name(self.param_dtype),
        }
        if self.architecture != "qwen2":
            d["attention_bias"] = False
        if self.architecture == "llama":
            d["mlp_bias"] = False
        elif self.architecture == "mistral":
            d["sliding_window"] = self.sliding_window if sliding else None
        elif self.gemma:
            local = {"rope_type": "default", "rope_theta": self.rope_local_theta or self.rope_theta}
            if self.rope_local_theta is None:
                local = dict(rope_parameters)
            d.pop("rope_scaling")
            scalar = float(self.query_pre_attn_scalar or self.head_dim)
            d.update(hidden_activation="gelu_pytorch_tanh",
                     query_pre_attn_scalar=int(scalar) if scalar.is_integer() else scalar, sliding_window=self.sliding_window or self.max_position_embeddings,
                     layer_types=types, rope_local_base_freq=local["rope_theta"],
                     rope_parameters={"full_attention": rope_parameters, "sliding_attention": local},
                     attn_logit_softcapping=None, final_logit_softcapping=None)
        elif self.architecture == "olmo3":
            local = {"rope_type": "default", "rope_theta": self.rope_local_theta or self.rope_theta}
            d.pop("rope_scaling")
            d.update(sliding_window=self.sliding_window or self.max_position_embeddings, layer_types=types,
                     rope_parameters={"full_attention": rope_parameters, "sliding_attention": local})
        elif self.architecture != "olmo2":
            if self.architecture == "smollm3":
                d.update(no_rope_layers=list(self.rope_layers or (1,) * self.num_layers), mlp_bias=False,
                         pad_token_id=None)  # its default (128004) lies outside a smaller vocabulary
            d["use_sliding_window"] = sliding
            d["sliding_window"] = self.sliding_window if sliding else None
            d["layer_types"] = types
            d["max_window_layers"] = types.index("sliding_attention") if sliding else self.num_layers
        return d

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
