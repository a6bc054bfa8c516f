"""ModelConfig: the hyper-parameters of the decoder family (Qwen2, Qwen3, Llama) and HF config.json I/O."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

ARCHITECTURES = ("qwen2", "qwen3", "llama", "mistral")
_HF_CLASS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
             "mistral": "MistralForCausalLM"}
_ROPE_TYPES = ("default", "llama3", "yarn")
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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one decoder-only transformer.

    architecture: "qwen2" (q/k/v bias), "qwen3" (q/k RMSNorm), or "llama" (optionally llama3 RoPE scaling).
    rope_scaling: None, or an HF-style dict such as {"rope_type": "llama3", "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, or YaRN's
      {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768} (Qwen2.5 / Qwen3 long context).
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
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in _ROPE_TYPES:
                raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported types are "
                                 f"{', '.join(_ROPE_TYPES)} (or rope_scaling=None).")
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

    def replace(self, **kwargs: Any) -> ModelConfig:
        """Returns a copy with the given fields changed (validated again)."""
        return dataclasses.replace(self, **kwargs)

    @property
    def num_params(self) -> int:
        """Total number of parameters (embedding counted once when tied)."""
        d, f, h, k, hd = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * h * hd * 2 + d * k * hd * 2 + (h * hd + 2 * k * hd if self.attention_bias else 0)
        attn += 2 * hd if self.qk_norm else 0
        layer = attn + 3 * d * f + 2 * d
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
        if model_type not in ARCHITECTURES:
            raise ValueError(f"Unknown architecture: model_type={d.get('model_type')!r}, architectures="
                             f"{d.get('architectures')!r}; supported model types are {', '.join(ARCHITECTURES)}.")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in d]
        if missing:
            raise ValueError(f"HF config for {model_type} lacks required keys {', '.join(missing)}.")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported (the MLP projections here have no bias).")
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported; only full attention is implemented.")
        window = d.get("sliding_window") if model_type == "mistral" else None
        if window is not None and int(window) < int(d.get("max_position_embeddings", 4096)):
            raise ValueError(f"sliding_window={window} (attention over the last {window} positions only) is not "
                             "supported; only full attention is implemented (Mistral v0.2 and later have "
                             "sliding_window null).")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d.get('hidden_act')!r} is not supported; only 'silu' (SwiGLU) is.")
        if model_type == "qwen2":
            attention_bias = True
        else:
            if d.get("attention_bias"):
                raise ValueError(f"attention_bias=True for {model_type} also adds an o_proj bias, which is not "
                                 "supported.")
            attention_bias = False
        rope = dict(d.get("rope_parameters") or {})
        if d.get("rope_scaling"):
            rope.update(d["rope_scaling"])
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported.")
        rope.pop("partial_rotary_factor", None)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        heads = d["num_attention_heads"]
        return cls(
            architecture=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else rope,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
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
        if self.architecture in ("llama", "mistral") and (self.attention_bias or self.qk_norm):
            raise ValueError(f"HF {self.architecture.title()} has no q/k/v bias and no q/k norm; set "
                             "attention_bias=False, qk_norm=False.")
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling)
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        d = {
            "architectures": [_HF_CLASS[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
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
            d["sliding_window"] = None
        else:
            d["use_sliding_window"] = False
            d["sliding_window"] = None
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
