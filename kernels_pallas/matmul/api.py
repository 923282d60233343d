"""Public dense quantized matmul, and its straight-through estimator for training.

``quantized_matmul`` checks its operands once and runs the backend's kernel (CPU: plain JAX over
fixed row blocks; GPU: Pallas-Triton; TPU: Pallas Mosaic), chosen, interpreted and tiled by the
keyword :class:`kernels_pallas._backend.Options`.

The STE trains on master weights with the rollout's exact forward: forward = ``quantizer(w_master)``
then the kernel, so it is bitwise the rollout's forward on frozen weights (training log-probs ==
rollout log-probs). Backward treats quantization (of the weight and, for w8a8/w4a8, of the
activations) as the identity: f32 matmuls with the dequantized weight, gradients for the
activations and the full-precision master weight. The residual is the quantized weight (the
integers and scales, not a float copy); the float weight is rebuilt in the backward, per layer.
"""

from __future__ import annotations

import functools
from typing import Unpack

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import _backend, _checks
from kernels_pallas._backend import Options, Target
from kernels_pallas.formats import QuantizedWeight, Quantizer, dequantize, quantize


def _matmul(x: jax.Array, w: QuantizedWeight, out_dtype, target: Target) -> jax.Array:
    _checks.matmul_operands(x, w, ndim=2)
    *lead, k = x.shape
    y = target.kernel("matmul", "matmul")(x.reshape(-1, k), w, out_dtype=out_dtype)
    return y.reshape(*lead, w.n)


class SteOptions(Options, total=False):
    """The straight-through estimators' keywords: the output dtype (default x's), the quantizer
    (default :func:`kernels_pallas.quantize`; ``qarl_jax.quant`` passes AQT's, which yields the same
    integers), and the kernel :class:`Options`."""

    out_dtype: jnp.dtype | None
    quantizer: Quantizer


def out_dtype_of(x: jax.Array, out_dtype) -> jnp.dtype:
    return x.dtype if out_dtype is None else jnp.dtype(out_dtype)


def quantized_matmul(
    x: jax.Array, w: QuantizedWeight, *, out_dtype=None, **options: Unpack[Options]
) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N], every row bitwise independent of the other rows."""
    return _matmul(x, w, out_dtype_of(x, out_dtype), _backend.target(options))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _ste(x, w_master, fmt, group_size, out_dtype, target, quantizer):
    return _matmul(x, quantizer(w_master, fmt, group_size), out_dtype, target)


def _ste_fwd(x, w_master, fmt, group_size, out_dtype, target, quantizer):
    wq = quantizer(w_master, fmt, group_size)
    return _matmul(x, wq, out_dtype, target), (x, w_master, wq)


def _ste_bwd(fmt, group_size, out_dtype, target, quantizer, res, g):
    x, w_master, wq = res
    k, n = w_master.shape
    if wq.scales is not None:
        # the float weight is rebuilt from the integers when this cotangent arrives, not before:
        # tied to g, XLA cannot hoist every layer's dequantized copy to the start of the backward
        # (bf16 has no integers: its "quantized" weight is the master itself, left to XLA to fuse)
        wq, g = lax.optimization_barrier((wq, g))
    w = dequantize(wq, jnp.float32)
    g2 = g.reshape(-1, n).astype(jnp.float32)
    x2 = x.reshape(-1, k).astype(jnp.float32)
    dx = jnp.matmul(g2, w.T, precision=lax.Precision.HIGHEST)
    dw = jnp.matmul(x2.T, g2, precision=lax.Precision.HIGHEST)
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w_master.dtype)


_ste.defvjp(_ste_fwd, _ste_bwd)


def quantized_matmul_ste(
    x: jax.Array, w_master: jax.Array, fmt: str, group_size: int | None = None, **options: Unpack[SteOptions]
) -> jax.Array:
    """x [..., K] @ quantizer(w_master [K, N], fmt, group_size), differentiable in x and w_master."""
    _checks.master_weight(w_master, ndim=2)
    out_dtype, quantizer = out_dtype_of(x, options.pop("out_dtype", None)), options.pop("quantizer", quantize)
    return _ste(x, w_master, fmt, group_size, out_dtype, _backend.target(options), quantizer)
