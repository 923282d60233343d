"""Row-wise operations of the forward, batch-invariant: RMSNorm, RoPE and the (chunked-vocabulary)
log-sum-exp behind log-softmax, token log-probs and the MoE router's softmax.

Why: XLA compiles a reduction for 1 row (decode) and for 4,096 rows (training) into different
programs, and the bits differ. Here every row is reduced by one fixed-shape per-block program (CPU:
plain JAX over fixed row blocks; GPU/TPU: Pallas kernels). The vocabulary is reduced in fixed
chunks of ``block_v`` columns with an online maximum, in ascending order, so a 151,936-entry row
never needs a second full-width temporary.

RoPE has no reduction, yet XLA:CPU computes its cos/sin and products with different bits in
different fusion contexts (measured: a packed forward and a KV-cache prefill disagreed; a
tensor-parallel engine's chain and the training forward's column-blocked one disagreed in f32), so
it is a fixed per-block program too, and on CPU a loop of its own even inside a fused chain.

Temperature: derived values are elementwise on top of one log-sum-exp of the tempered logits
``z = x * (1 / t)`` (``z - lse(z)``), so ``log_softmax(x, t)`` at the target and
``token_logprobs(x, target, t)`` are the same bits, and a float ``t`` (trainer) gives the same
bits as a per-row array of it (rollout slots). The reciprocal is rounded once per row and the
product is materialised (CPU: in row blocks) before anything reads it. Why not ``x / t`` in place:
XLA:CPU turns a division by a broadcast into a multiply by the reciprocal in some programs only,
then contracts that multiply with the ``- lse`` into an FMA in some fusions only (measured: 1-ulp
log-prob differences). Temperature 1 (a Python number) skips the scaling.

Keyword options: ``block_v`` (the vocabulary chunk, every backend) and the kernel
:class:`kernels_pallas._backend.Options` (the CPU path's knob is ``block_rows``). Gradients
(custom VJPs) use the plain formulas: the backward pass need not be invariant.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Unpack

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import _backend
from kernels_pallas._backend import Options, Target
from kernels_pallas._tiling import next_pow2
from kernels_pallas.rowwise.reference import reference_rms_norm, reference_rope

Temperature = float | jax.Array


def default_block_v(v: int) -> int:
    """Vocabulary chunk: the smallest power of two >= V (at least 16), at most 2,048: a function of
    V only."""
    return min(max(16, next_pow2(v)), 2048)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x, weight, eps, target):
    d = x.shape[-1]
    return target.kernel("rowwise", "rms_norm")(x.reshape(-1, d), weight, eps=eps).reshape(x.shape)


def _rms_norm_fwd(x, weight, eps, target):
    return _rms_norm(x, weight, eps, target), (x, weight)


def _rms_norm_bwd(eps, target, res, g):
    _, vjp = jax.vjp(lambda x, w: reference_rms_norm(x, w, eps), *res)
    return vjp(g)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, **options: Unpack[Options]) -> jax.Array:
    """RMSNorm over the last axis (Qwen3 numerics), each row bitwise independent of the others."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight has shape {weight.shape}, expected ({x.shape[-1]},)")
    return _rms_norm(x, weight, float(eps), _backend.target(options))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rope(x, positions, theta, inv_freq, target):
    h, d = x.shape[-2:]
    x3d, p1d = x.reshape(-1, h, d), positions.reshape(-1).astype(jnp.int32)
    return target.kernel("rowwise", "rope")(x3d, p1d, theta=theta, inv_freq=inv_freq).reshape(x.shape)


def _rope_fwd(x, positions, theta, inv_freq, target):
    return _rope(x, positions, theta, inv_freq, target), positions


def _rope_bwd(theta, inv_freq, target, positions, g):
    # the rotation is orthogonal: its transpose is the rotation by the opposite angle
    return reference_rope(g, -positions, theta, inv_freq), None


_rope.defvjp(_rope_fwd, _rope_bwd)


def rope(
    x: jax.Array,
    positions: jax.Array,
    theta: float,
    inv_freq: Sequence[float] | None = None,
    **options: Unpack[Options],
) -> jax.Array:
    """Rotary embedding of x [..., H, D] at positions [...], each token bitwise independent of the
    others (Qwen3 numerics: angles in f32, rotate_half). ``inv_freq``: the D/2 inverse frequencies
    of a scaled RoPE (Llama 3's ``llama3`` scaling rewrites theta's), rounded to f32; they are
    compile-time constants of the kernel, like theta's."""
    if x.shape[:-2] != positions.shape or x.shape[-1] % 2:
        raise ValueError(f"x {x.shape} must be [..., H, D] (D even) with positions {x.shape[:-2]}")
    freqs = None
    if inv_freq is not None:
        freqs = tuple(float(f) for f in np.asarray(inv_freq, np.float32).reshape(-1))
        if len(freqs) != x.shape[-1] // 2:
            raise ValueError(
                f"inv_freq has {len(freqs)} entries, head_dim {x.shape[-1]} needs {x.shape[-1] // 2}"
            )
    return _rope(x, positions, float(theta), freqs, _backend.target(options))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _logsumexp(x, block_v, target):
    v = x.shape[-1]
    lse = target.kernel("rowwise", "logsumexp")(x.reshape(-1, v), block_v=block_v or default_block_v(v))
    return lse.reshape(x.shape[:-1])


def _logsumexp_fwd(x, block_v, target):
    lse = _logsumexp(x, block_v, target)
    return lse, (x, lse)


def _logsumexp_bwd(block_v, target, res, g):
    x, lse = res
    return ((g[..., None] * jnp.exp(x.astype(jnp.float32) - lse[..., None])).astype(x.dtype),)


_logsumexp.defvjp(_logsumexp_fwd, _logsumexp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scale(x, inv, target):
    v = x.shape[-1]
    return target.kernel("rowwise", "scale_rows")(x.reshape(-1, v), inv.reshape(-1)).reshape(x.shape)


def _scale_fwd(x, inv, target):
    return _scale(x, inv, target), inv


def _scale_bwd(target, inv, g):
    return g * inv[..., None], jnp.zeros_like(inv)


_scale.defvjp(_scale_fwd, _scale_bwd)


def _untempered(temperature: Temperature) -> bool:
    """A Python-number temperature of 1 (checked to be positive): no scaling at all."""
    if isinstance(temperature, int | float):
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        return temperature == 1
    return False


def _tempered(x: jax.Array, temperature: Temperature, target: Target) -> tuple[jax.Array, jax.Array]:
    """(f32 values the derived quantities subtract the log-sum-exp from, the log-sum-exp's input):
    ``x`` itself at temperature 1, else ``z = x * (1 / t)`` for both (``t`` a number or an array
    broadcastable to the row shape ``x.shape[:-1]``)."""
    if _untempered(temperature):
        return x.astype(jnp.float32), x
    inv = 1 / jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), x.shape[:-1])
    z = _scale(x.astype(jnp.float32), inv, target)
    return z, z


class RowOptions(Options, total=False):
    """The log-sum-exp family's keywords: the vocabulary chunk ``block_v`` (default
    :func:`default_block_v`) and the kernel :class:`Options`."""

    block_v: int | None


def _lse_target(options: RowOptions) -> tuple[int | None, Target]:
    block_v = options.pop("block_v", None)
    return block_v, _backend.target(options)


def logsumexp(x: jax.Array, temperature: Temperature = 1.0, **options: Unpack[RowOptions]) -> jax.Array:
    """log(sum(exp(x / temperature))) over the last axis in f32, vocabulary chunk by chunk."""
    block_v, target = _lse_target(options)
    return _logsumexp(_tempered(x, temperature, target)[1], block_v, target)


def log_softmax(x: jax.Array, temperature: Temperature = 1.0, **options: Unpack[RowOptions]) -> jax.Array:
    """Log-probabilities of ``x / temperature`` over the last axis (f32)."""
    block_v, target = _lse_target(options)
    z, src = _tempered(x, temperature, target)
    return z - _logsumexp(src, block_v, target)[..., None]


def softmax(x: jax.Array, temperature: Temperature = 1.0, **options: Unpack[RowOptions]) -> jax.Array:
    """Probabilities over the last axis (f32), exp of :func:`log_softmax`."""
    return jnp.exp(log_softmax(x, temperature, **options))


def token_logprobs(
    x: jax.Array, targets: jax.Array, temperature: Temperature = 1.0, **options: Unpack[RowOptions]
) -> jax.Array:
    """log p(target): x [..., V], targets [...] -> [...] f32, bitwise ``log_softmax(x)[target]``."""
    block_v, target = _lse_target(options)
    _, src = _tempered(x, temperature, target)
    picked = jnp.take_along_axis(src, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked.astype(jnp.float32) - _logsumexp(src, block_v, target)
