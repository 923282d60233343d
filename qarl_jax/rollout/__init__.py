"""Rollout: the plain-JAX engine core (prefill / insert / generate over a KV cache), on-device
sampling and the batch RL driver. The JetStream adapter lives in ``jetstream_engine`` and is never
imported from here (it pulls in TensorFlow)."""

from qarl_jax.rollout.driver import Sample, rollout
from qarl_jax.rollout.engine import (
    DecodeState,
    EngineConfig,
    Prefix,
    RolloutEngine,
    SlotRequest,
    SlotSettings,
    StepOutput,
    sample_key,
)
from qarl_jax.rollout.sampling import GREEDY, SamplingParams

__all__ = [
    "GREEDY",
    "DecodeState",
    "EngineConfig",
    "Prefix",
    "RolloutEngine",
    "Sample",
    "SamplingParams",
    "SlotRequest",
    "SlotSettings",
    "StepOutput",
    "rollout",
    "sample_key",
]
