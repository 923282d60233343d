"""Pieces of the row-wise programs that the CPU, GPU and TPU paths share, so that they compute
the same thing in the same order."""

from __future__ import annotations

import decimal
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BLOCK_ROWS = 16  # rows per program of the Pallas kernels (a bf16 sublane tile on TPU)


def rms_rows(x: jax.Array, weight: jax.Array, eps: float, d: int, dtype) -> jax.Array:
    """RMSNorm of rows zero-padded past width ``d`` (the mean divides by the true width)."""
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.sum(xf * xf, axis=1, keepdims=True) / d + eps)
    return weight.astype(dtype) * y.astype(dtype)


PI_40 = decimal.Decimal("3.141592653589793238462643383279502884197169399375")  # past 40 digits


def exact_inv_freq(theta: float, d: int) -> list[decimal.Decimal]:
    """RoPE's D/2 inverse frequencies ``1 / theta ** (2i / d)`` to 40 digits, in decimal's software
    arithmetic: the same digits on every host (f32 or f64 ``power`` is the CPU's: numpy's AVX-512
    path and its baseline differ in the last bit)."""
    with decimal.localcontext() as ctx:
        ctx.prec = 40
        base = decimal.Decimal(repr(float(theta)))
        return [1 / base ** (decimal.Decimal(i) / d) for i in range(0, d, 2)]


@functools.lru_cache(maxsize=64)
def _theta_inv_freq(theta: float, d: int) -> tuple[float, ...]:
    return tuple(float(np.float32(float(f))) for f in exact_inv_freq(theta, d))


def inv_freq(theta: float, d: int, given: tuple[float, ...] | None = None) -> np.ndarray:
    """RoPE's D/2 inverse frequencies in f32, host-independent constants of every backend's
    program: ``given`` ones (a scaled RoPE's) as they are, else ``theta``'s, each the f32 nearest
    its exact value (:func:`exact_inv_freq`; the 40-digit value goes through f64, whose second
    rounding can only matter within 2**-29 ulp of an f32 tie, and does so on every host alike)."""
    if given is not None:
        return np.asarray(given, np.float32)
    return np.asarray(_theta_inv_freq(float(theta), int(d)), np.float32)


_frequencies = inv_freq  # pallas_rope's keyword ``inv_freq`` hides the function's name


def pallas_rope(
    body: Callable[[jax.Array, jax.Array, np.ndarray, bool], jax.Array],
) -> Callable[..., jax.Array]:
    """A Pallas backend's ``rope`` (GPU and TPU take the same arguments, one jit) from
    ``body(x [M, H, D], positions [M], inv_freq [D/2] f32, interpret)``."""

    @functools.partial(jax.jit, static_argnames=("theta", "inv_freq", "interpret"))
    def rope(
        x: jax.Array,
        positions: jax.Array,
        *,
        theta: float,
        inv_freq: tuple[float, ...] | None = None,
        interpret: bool = False,
    ) -> jax.Array:
        """x [M, H, D] rotated at positions [M] (angles in f32, rotate_half), rows invariant;
        ``inv_freq``: a scaled RoPE's D/2 frequencies instead of ``theta``'s."""
        return body(x, positions, _frequencies(theta, x.shape[-1], inv_freq), interpret)

    return rope


def lse_step(m: jax.Array, s: jax.Array, z: jax.Array, keepdims: bool = False) -> tuple[jax.Array, jax.Array]:
    """One vocabulary chunk ``z`` [rows, chunk] into the running (max, sum of exp) of each row."""
    m_new = jnp.maximum(m, jnp.max(z, axis=-1, keepdims=keepdims))
    shift = m_new if keepdims else m_new[..., None]
    return m_new, s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - shift), axis=-1, keepdims=keepdims)


def scale_rows(x: jax.Array, inv: jax.Array, *, interpret: bool = False) -> jax.Array:
    """x [M, V] * inv [M] on an accelerator: XLA's multiply (the kernels reading the product are
    opaque custom calls; the CPU path materialises it in row blocks instead). ``interpret``
    changes nothing: there is no Pallas kernel to interpret."""
    del interpret
    return x * inv[:, None]
