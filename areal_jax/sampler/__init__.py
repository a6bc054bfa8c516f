"""JetStream-style decode engine (pure, jitted) and the continuous-batching sampler loop."""
from areal_jax.sampler.batch import generate_batch
from areal_jax.sampler.engine import Engine
from areal_jax.sampler.loop import SamplerLoop
from areal_jax.sampler.requests import Completion, Request, SamplerLoopError
from areal_jax.sampler.sampling import SamplingParams, behaviour_log_probs, filtered_logits, sample_tokens
from areal_jax.sampler.state import DecodeState, Prefix, SlotSettings, StepResult

__all__ = [
    "Completion", "DecodeState", "Engine", "Prefix", "Request", "SamplerLoop", "SamplerLoopError",
    "SamplingParams", "SlotSettings", "StepResult", "behaviour_log_probs", "filtered_logits", "generate_batch",
    "sample_tokens",
]
