"""Row-wise operations of the forward, batch-invariant: RMSNorm, RoPE and the (chunked-vocabulary)
log-sum-exp behind log-softmax, token log-probs and the MoE router's softmax.

Why: XLA compiles a reduction for 1 row (decode) and for 4,096 rows (training) into different
programs, and the bits differ. Here every row is reduced by one fixed-shape per-block program: the
CPU path is plain JAX over fixed row blocks (:mod:`kernels_pallas.cpu_rows`), GPU and TPU run the
Pallas kernels in ``kernels_pallas.{gpu,tpu}.rowwise`` (imported lazily). The vocabulary is
reduced in fixed chunks of ``block_v`` columns with an online maximum, in ascending order, so a
151,936-entry row never needs a second full-width temporary.

RoPE has no reduction, yet XLA:CPU computes its cos/sin and products with different bits in
different fusion contexts (measured: a packed forward and a KV-cache prefill disagreed), so it is a
fixed per-block program too.

Derived values are elementwise on top of one log-sum-exp (``x / t - lse``), so ``log_softmax(x)``
at the target and ``token_logprobs(x, target)`` are the same bits. Gradients (custom VJP) use the
plain formulas: the backward pass need not be invariant.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import cpu_rows
from kernels_pallas.matmul import resolve_backend

NEG_INF = float("-inf")


def default_block_v(v: int, cap: int = 2048) -> int:
    """Vocabulary chunk: the smallest power of two >= V, at most ``cap`` (a function of V only)."""
    b = 16
    while b < v and b < cap:
        b *= 2
    return b


def _accelerator(backend: str, name: str):
    try:
        return getattr(importlib.import_module(f"kernels_pallas.{backend}.rowwise"), name)
    except (ImportError, AttributeError) as err:
        raise RuntimeError(
            f"no {backend} row-wise kernel {name!r} ({err}); pass backend='cpu' for the plain-JAX path"
        ) from err


def reference_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3's RMSNorm in plain XLA: normalise in f32, cast to the input dtype, then scale."""
    xf = x.astype(jnp.float32)
    xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def reference_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, non-interleaved halves (rotate_half), angles in f32: x [..., H, D],
    positions [...]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def reference_logsumexp(x: jax.Array, temperature: float = 1.0) -> jax.Array:
    return jax.nn.logsumexp(x.astype(jnp.float32) / temperature, axis=-1)


@functools.partial(jax.jit, static_argnames=("eps", "block_rows"))
def _cpu_rms_norm(x2d: jax.Array, weight: jax.Array, eps: float, block_rows: int) -> jax.Array:
    w = weight.astype(x2d.dtype)

    def block(xb):
        return (reference_rms_norm(xb, w, eps),)

    out = jax.ShapeDtypeStruct(x2d.shape[1:], x2d.dtype)
    return cpu_rows.map_row_blocks(block, (x2d,), block_rows, (out,))[0]


@functools.partial(jax.jit, static_argnames=("theta", "block_rows"))
def _cpu_rope(x3d: jax.Array, positions: jax.Array, theta: float, block_rows: int) -> jax.Array:
    def block(xb, pb):
        return (reference_rope(xb, pb, theta),)

    out = jax.ShapeDtypeStruct(x3d.shape[1:], x3d.dtype)
    return cpu_rows.map_row_blocks(block, (x3d, positions), block_rows, (out,))[0]


@functools.partial(jax.jit, static_argnames=("temperature", "block_rows", "block_v"))
def _cpu_logsumexp(x2d: jax.Array, temperature: float, block_rows: int, block_v: int) -> jax.Array:
    v = x2d.shape[1]
    chunks = -(-v // block_v)
    xp = jnp.pad(x2d.astype(jnp.float32), ((0, 0), (0, chunks * block_v - v)), constant_values=NEG_INF)
    t = _opaque(temperature)

    def block(xb):
        xc = xb.reshape(block_rows, chunks, block_v)

        def step(c, carry):
            m, s = carry
            z = lax.dynamic_index_in_dim(xc, c, axis=1, keepdims=False) / t
            m_new = jnp.maximum(m, jnp.max(z, axis=-1))
            s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=-1)
            return m_new, s

        init = (jnp.full((block_rows,), NEG_INF, jnp.float32), jnp.zeros((block_rows,), jnp.float32))
        m, s = lax.fori_loop(0, chunks, step, init)
        return (m + jnp.log(s),)

    out = jax.ShapeDtypeStruct((), jnp.float32)
    return cpu_rows.map_row_blocks(block, (xp,), block_rows, (out,))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rms_norm(x, weight, eps, block_rows, backend):
    d = x.shape[-1]
    x2d = x.reshape(-1, d)
    if backend == "cpu":
        y = _cpu_rms_norm(x2d, weight, eps, block_rows or cpu_rows.pow2_rows(d))
    else:
        y = _accelerator(backend, "rms_norm")(x2d, weight, eps=eps)
    return y.reshape(x.shape)


def _rms_norm_fwd(x, weight, eps, block_rows, backend):
    return _rms_norm(x, weight, eps, block_rows, backend), (x, weight)


def _rms_norm_bwd(eps, block_rows, backend, res, g):
    _, vjp = jax.vjp(lambda x, w: reference_rms_norm(x, w, eps), *res)
    return vjp(g)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(
    x: jax.Array, weight: jax.Array, eps: float, *, block_rows: int | None = None, backend: str | None = None
) -> jax.Array:
    """RMSNorm over the last axis (Qwen3 numerics), each row bitwise independent of the others."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight has shape {weight.shape}, expected ({x.shape[-1]},)")
    return _rms_norm(x, weight, float(eps), block_rows, resolve_backend(backend))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rope(x, positions, theta, block_rows, backend):
    h, d = x.shape[-2:]
    x3d, p1d = x.reshape(-1, h, d), positions.reshape(-1).astype(jnp.int32)
    if backend == "cpu":
        y = _cpu_rope(x3d, p1d, theta, block_rows or cpu_rows.pow2_rows(h * d))
    else:
        y = _accelerator(backend, "rope")(x3d, p1d, theta=theta)
    return y.reshape(x.shape)


def _rope_fwd(x, positions, theta, block_rows, backend):
    return _rope(x, positions, theta, block_rows, backend), positions


def _rope_bwd(theta, block_rows, backend, positions, g):
    # the rotation is orthogonal: its transpose is the rotation by the opposite angle
    return reference_rope(g, -positions, theta), None


_rope.defvjp(_rope_fwd, _rope_bwd)


def rope(
    x: jax.Array,
    positions: jax.Array,
    theta: float,
    *,
    block_rows: int | None = None,
    backend: str | None = None,
) -> jax.Array:
    """Rotary embedding of x [..., H, D] at positions [...], each token bitwise independent of the
    others (Qwen3 numerics: angles in f32, rotate_half)."""
    if x.shape[:-2] != positions.shape or x.shape[-1] % 2:
        raise ValueError(f"x {x.shape} must be [..., H, D] (D even) with positions {x.shape[:-2]}")
    return _rope(x, positions, float(theta), block_rows, resolve_backend(backend))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _logsumexp(x, temperature, block_rows, block_v, backend):
    v = x.shape[-1]
    x2d = x.reshape(-1, v)
    block_v = block_v or default_block_v(v)
    if backend == "cpu":
        out = _cpu_logsumexp(x2d, temperature, block_rows or cpu_rows.pow2_rows(block_v), block_v)
    else:
        out = _accelerator(backend, "logsumexp")(x2d, temperature=temperature, block_v=block_v)
    return out.reshape(x.shape[:-1])


def _logsumexp_fwd(x, temperature, block_rows, block_v, backend):
    lse = _logsumexp(x, temperature, block_rows, block_v, backend)
    return lse, (x, lse)


def _logsumexp_bwd(temperature, block_rows, block_v, backend, res, g):
    x, lse = res
    probs = jnp.exp(x.astype(jnp.float32) / temperature - lse[..., None])
    return ((g[..., None] * probs / temperature).astype(x.dtype),)


_logsumexp.defvjp(_logsumexp_fwd, _logsumexp_bwd)


def logsumexp(
    x: jax.Array,
    temperature: float = 1.0,
    *,
    block_rows: int | None = None,
    block_v: int | None = None,
    backend: str | None = None,
) -> jax.Array:
    """log(sum(exp(x / temperature))) over the last axis in f32, vocabulary chunk by chunk."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    return _logsumexp(x, float(temperature), block_rows, block_v, resolve_backend(backend))


def _opaque(temperature: float) -> jax.Array:
    """The temperature behind an optimization barrier. Not enough for bitwise equality across
    programs on XLA:CPU: the barrier on a constant is folded away, and a division by a broadcast
    becomes a multiply by the reciprocal (then an FMA with the next subtraction) in some programs
    only (measured: 1-ulp log-prob differences at temperature 0.7). Callers that need the same bits
    in different programs scale the logits once themselves and call these kernels at temperature 1,
    as ``qarl_jax.models.ops`` does."""
    return lax.optimization_barrier(jnp.float32(temperature))


def scaled(x: jax.Array, temperature: float) -> jax.Array:
    """x / temperature in f32: the one elementwise step every derived value shares."""
    xf = x.astype(jnp.float32)
    return xf if temperature == 1.0 else xf / _opaque(temperature)


def log_softmax(x: jax.Array, temperature: float = 1.0, **kw) -> jax.Array:
    """Log-probabilities over the last axis (f32)."""
    return scaled(x, temperature) - logsumexp(x, temperature, **kw)[..., None]


def softmax(x: jax.Array, temperature: float = 1.0, **kw) -> jax.Array:
    """Probabilities over the last axis (f32), exp of :func:`log_softmax`."""
    return jnp.exp(log_softmax(x, temperature, **kw))


def token_logprobs(x: jax.Array, targets: jax.Array, temperature: float = 1.0, **kw) -> jax.Array:
    """log p(target): x [..., V], targets [...] -> [...] f32, bitwise ``log_softmax(x)[target]``."""
    picked = jnp.take_along_axis(x, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return scaled(picked, temperature) - logsumexp(x, temperature, **kw)
