"""Group-relative advantages: rewards of the G samples of each prompt, normalised within the group."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ADVANTAGES = ("grpo", "dr_grpo")
STDS = ("sample", "population")
FLAT = 1e-6  # a group whose reward std is below this has no signal: its advantages are 0


def group_std(rewards: jax.Array, std: str = "sample") -> jax.Array:
    """[P, G] -> [P, 1] per-group reward std: ``sample`` divides by G - 1 (verl, Tunix and the
    Dr. GRPO authors' code), ``population`` by G; a group of one sample has std 0."""
    if std not in STDS:
        raise ValueError(f"unknown advantage std {std!r}; expected one of {STDS}")
    ddof = 1 if std == "sample" and rewards.shape[1] > 1 else 0
    return jnp.std(rewards, axis=1, keepdims=True, ddof=ddof)


def informative_groups(rewards: jax.Array | np.ndarray) -> jax.Array:
    """[P, G] -> [P] bool: the groups whose advantages are not all zero (rewards not all equal)."""
    return group_std(jnp.asarray(rewards, jnp.float32), "population")[:, 0] > FLAT


def group_advantages(
    rewards: jax.Array | np.ndarray, mode: str = "grpo", eps: float = 1e-6, std: str = "sample"
) -> jax.Array:
    """rewards [P, G] (G samples per prompt) -> advantages [P, G].

    ``grpo``: (r - mean) / (std + eps), the std per ``std``; ``dr_grpo``: r - mean (Dr. GRPO drops
    the std). A group whose rewards are all equal gets exactly zero (never NaN, never rounding
    noise / eps): :func:`informative_groups` names the others."""
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [prompts, samples_per_prompt], got shape {rewards.shape}")
    r = jnp.asarray(rewards, jnp.float32)
    centred = r - jnp.mean(r, axis=1, keepdims=True)
    if mode == "grpo":
        adv = centred / (group_std(r, std) + eps)
    elif mode == "dr_grpo":
        adv = centred
    else:
        raise ValueError(f"unknown advantage mode {mode!r}; expected one of {ADVANTAGES}")
    return jnp.where(informative_groups(r)[:, None], adv, 0.0)
