"""Group-relative advantages: rewards of the G samples of each prompt, normalised within the group."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_FLAT = 1e-6  # a group whose reward std is below this has no signal: its advantages are 0


def group_advantages(rewards: jax.Array, mode: str = "grpo", eps: float = 1e-6) -> jax.Array:
    """rewards [P, G] (G samples per prompt) -> advantages [P, G].

    ``grpo``: (r - mean) / (std + eps); ``dr_grpo``: r - mean (Dr. GRPO drops the std). A group
    whose rewards are all equal gets exactly zero (never NaN, never rounding noise / eps)."""
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [prompts, samples_per_prompt], got shape {rewards.shape}")
    r = rewards.astype(jnp.float32)
    centred = r - jnp.mean(r, axis=1, keepdims=True)
    std = jnp.std(r, axis=1, keepdims=True)
    if mode == "grpo":
        adv = centred / (std + eps)
    elif mode == "dr_grpo":
        adv = centred
    else:
        raise ValueError(f"unknown advantage mode {mode!r}; expected 'grpo' or 'dr_grpo'")
    return jnp.where(std > _FLAT, adv, 0.0)
