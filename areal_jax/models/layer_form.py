"""`LayerForm`: what each family's layers look like, read off the config's architecture (the HF model type), as
properties `ModelConfig` inherits. Family knowledge the generic modules (layers, transformer, rope, the weight table,
the parameter counts) need lives here, not in them."""
from __future__ import annotations


class LayerForm:
    """The layer-form properties of a `ModelConfig` (each reads only `architecture` and the properties here)."""

    architecture: str

    @property
    def gemma(self) -> bool:
        """Gemma's layer form: norms scale by 1 + w (stored as w), GELU-tanh, embeddings x sqrt(D); Gemma 2 / 3 also
        `sandwich_norms`."""
        return self.architecture in ("gemma", "gemma2", "gemma3")

    @property
    def norm_offset(self) -> bool:
        """Whether the norms scale by 1 + w (weights stored as the offset from one): Gemma's and Qwen3.5's RMSNorms,
        Nemotron's LayerNorm1P."""
        return self.gemma or self.gated_attention or self.architecture == "nemotron"

    @property
    def weightless_norms(self) -> bool:
        """Whether the norms have no scale (NanoChat's RMSNorms: the embeddings are normalised too, `embedding_norm`;
        OLMo's LayerNorms, which have no bias either)."""
        return self.architecture in ("nanochat", "olmo")

    @property
    def embedding_norm(self) -> bool:
        """Whether the embeddings are RMS-normalised (no scale) before the first layer (NanoChat)."""
        return self.architecture == "nanochat"

    @property
    def rope_reversed(self) -> bool:
        """Whether the rotary pairs turn the other way (sin negated: NanoChat's)."""
        return self.architecture == "nanochat"

    @property
    def norm_after_rope(self) -> bool:
        """Whether the q/k norms take the rotated queries and keys (Hunyuan's, NanoChat's), not the projections."""
        return self.architecture.startswith("hunyuan") or self.architecture == "nanochat"

    @property
    def layer_norm(self) -> bool:
        """Whether the norms are LayerNorms (mean removed, then a scale; `norm_bias`: and a bias) rather than RMSNorms
        (PhiMoE, Cohere, StarCoder2, GPT-NeoX, Phi, StableLM, OLMo, Jais 2, Nemotron)."""
        return self.architecture in ("phimoe", "cohere", "cohere2", "starcoder2", "gpt_neox", "phi", "stablelm", "olmo",
                                     "jais2", "nemotron")

    @property
    def norm_bias(self) -> bool:
        """Whether the LayerNorms have a bias besides their scale (PhiMoE's, StarCoder2's, GPT-NeoX's, Phi's,
        StableLM's, Jais 2's, Nemotron's; Cohere's have none)."""
        return self.architecture in ("phimoe", "starcoder2", "gpt_neox", "phi", "stablelm", "jais2", "nemotron")

    @property
    def parallel_block(self) -> bool:
        """Cohere's (and Phi's) layer form: x + attn(norm(x)) + mlp(norm(x)), one norm feeding both (no norm before the
        MLP); GPT-NeoX's with a norm of x of the MLP's own (`parallel_mlp_norm`)."""
        return self.architecture in ("cohere", "cohere2", "gpt_neox", "phi")

    @property
    def parallel_mlp_norm(self) -> bool:
        """Whether a parallel block's MLP reads a norm of its own (GPT-NeoX's post_attention_layernorm, of x)."""
        return self.architecture == "gpt_neox"

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLPs (and experts) have a gate: down(act(x @ gate) * (x @ up)); else down(act(x @ up))
        (Arcee, Nemotron-H, Nemotron, NanoChat, Jais 2: hidden_act relu2; StarCoder2, GPT-NeoX, Phi: GELU; Apertus:
        xIELU)."""
        return self.architecture not in ("arcee", "nemotron_h", "nemotron", "nanochat", "starcoder2", "gpt_neox", "phi",
                                         "apertus", "jais2")

    @property
    def mlp_activation(self) -> str:
        """The MLPs' activation: "silu", "gelu_tanh" (GELU with the tanh approximation: Gemma's, StarCoder2's, Phi's), "gelu"
        (the exact one, GPT-NeoX's), "xielu" (Apertus': `layers.xielu`) or "relu2" (relu(x) ** 2: the other ungated
        MLPs')."""
        if self.architecture in ("gpt_neox", "apertus"):
            return {"gpt_neox": "gelu", "apertus": "xielu"}[self.architecture]
        if self.gemma or self.architecture in ("starcoder2", "phi"):
            return "gelu_tanh"
        return "silu" if self.gated_mlp else "relu2"

    @property
    def gated_attention(self) -> bool:
        """Whether q_proj also gives each head's output gate, the attention's output times sigmoid(gate) (Qwen3.5)."""
        return self.architecture in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")

    @property
    def sandwich_norms(self) -> bool:
        """Norms before and after both attention and the MLP (Gemma 2 / 3, GLM-4, LFM3)."""
        return self.architecture in ("gemma2", "gemma3", "glm4", "lfm3")

    @property
    def olmo(self) -> bool:
        """OLMo 2 / 3's layer form (EXAONE 4's, FlexOlmo's too; OLMo Hybrid's attention layers, its Gated DeltaNet ones
        pre-norm): x + norm(attn(x)), then x + norm(mlp(x)) (no norm before either)."""
        return self.architecture in ("olmo2", "olmo3", "exaone4", "flex_olmo", "olmo_hybrid")

    @property
    def flat_qk_norm(self) -> bool:
        """q/k norms over the whole projection (all heads together: OLMo 2 / 3, OLMoE, MiniMax-M2), not per head."""
        return self.architecture in ("olmo2", "olmo3", "olmoe", "minimax_m2", "flex_olmo", "olmo_hybrid")
