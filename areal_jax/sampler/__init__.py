"""JetStream-style decode engine (pure, jitted) and the continuous-batching sampler loop."""
from areal_jax.sampler.batch import generate_batch
from areal_jax.sampler.engine import DecodeState, Engine, Prefix, StepResult
from areal_jax.sampler.loop import Completion, Request, SamplerLoop, SamplerLoopError
from areal_jax.sampler.sampling import SamplingParams, behaviour_log_probs, filtered_logits, sample_tokens

__all__ = [
    "Completion", "DecodeState", "Engine", "Prefix", "Request", "SamplerLoop", "SamplerLoopError",
    "SamplingParams", "StepResult", "behaviour_log_probs", "filtered_logits", "generate_batch",
    "sample_tokens",
]
