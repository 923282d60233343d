"""Operand checks, one per operand kind, run once by each public entry point (the backend kernels
trust their inputs): a clear one-line error for what no kernel can compute."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.formats import VALUE_DTYPE, WEIGHT_BITS, QuantizedWeight, check_format

ACTIVATION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def activations(x: jax.Array, name: str = "x") -> None:
    if jnp.dtype(x.dtype) not in ACTIVATION_DTYPES:
        raise TypeError(
            f"{name} must be bfloat16, float16 or float32, got {x.dtype} (floating-point activations)"
        )


def weight(w: QuantizedWeight, ndim: int) -> None:
    """A weight whose format, rank, dtypes and scale shape match the data contract; ``ndim`` 2 is
    [K, N], 3 the experts' [E, K, N]."""
    if not isinstance(w, QuantizedWeight):
        raise TypeError(f"expected a QuantizedWeight, got {type(w).__name__} (use kernels_pallas.quantize)")
    check_format(w.fmt)
    if w.values.ndim != ndim:
        layout = "[E, K, N]" if ndim == 3 else "[K, N]"
        raise ValueError(f"expected a weight of rank {ndim} {layout}, got values of shape {w.values.shape}")
    if WEIGHT_BITS[w.fmt] is None:
        activations(w.values, "bf16-format weight values")
        if w.scales is not None:
            raise ValueError("bf16-format weights carry no scales")
        return
    want_dtype = jnp.dtype(VALUE_DTYPE[w.fmt])
    if w.values.dtype != want_dtype:
        raise TypeError(f"{w.fmt} weight values must be {want_dtype}, got {w.values.dtype}")
    if w.k % w.group_size:
        raise ValueError(f"{w.fmt}: K={w.k} is not a multiple of the group size {w.group_size}")
    want = (*w.values.shape[:-2], w.k // w.group_size, w.n)
    if w.scales is None or w.scales.shape != want:
        got = None if w.scales is None else w.scales.shape
        raise ValueError(f"{w.fmt} scales must have shape {want}, got {got}")


def matmul_operands(x: jax.Array, w: QuantizedWeight, ndim: int) -> None:
    """x [..., K] (dense) or [M, K] (experts, ``ndim`` 3) against a weight of rank ``ndim``."""
    activations(x)
    weight(w, ndim)
    if ndim == 3 and (x.ndim != 2 or x.shape[1] != w.k):
        raise ValueError(f"x must be [M, K={w.k}], got shape {x.shape}")
    if x.ndim < 1 or x.shape[-1] != w.k:
        raise ValueError(f"x has shape {x.shape}; its last dimension must be K={w.k}")


def group_sizes(sizes: jax.Array, experts: int) -> None:
    if sizes.shape != (experts,) or not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes must be an integer array of shape ({experts},); got {sizes.dtype} {sizes.shape}"
        )


def master_weight(w: jax.Array, ndim: int) -> None:
    """A straight-through estimator's full-precision weight: [K, N], or the experts' [E, K, N]."""
    if w.ndim != ndim:
        raise ValueError(f"w_master must be {'[E, K, N]' if ndim == 3 else '[K, N]'}, got shape {w.shape}")
