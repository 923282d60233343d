"""Public dense quantized matmul, and its straight-through estimator for training.

``quantized_matmul`` checks its operands once and runs the backend's kernel (CPU: plain JAX over
fixed row blocks; GPU: Pallas-Triton; TPU: Pallas Mosaic). ``interpret=True`` runs the GPU/TPU
kernel in Pallas' interpreter (on a CPU); ``**tiling`` overrides the backend's block sizes (CPU:
``block_rows``; GPU: ``block_m, block_n, block_k, num_warps, num_stages, split_k, swap_ab,
int_dot``; TPU: ``block_m, block_n, block_k``). Overrides must be the same for every call whose
rows are compared: they fix the program a row runs.

The STE trains on master weights with the rollout's exact forward: forward = ``quantizer(w_master)``
then the kernel, so it is bitwise the rollout's forward on frozen weights (training log-probs ==
rollout log-probs). Backward treats quantization (of the weight and, for w8a8/w4a8, of the
activations) as the identity: f32 matmuls with the dequantized weight, gradients for the
activations and the full-precision master weight.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import _backend, _checks
from kernels_pallas._backend import Knob, Target
from kernels_pallas.formats import QuantizedWeight, Quantizer, dequantize, quantize


def _matmul(x: jax.Array, w: QuantizedWeight, out_dtype, target: Target) -> jax.Array:
    _checks.matmul_operands(x, w, ndim=2)
    *lead, k = x.shape
    y = target.kernel("matmul", "matmul")(x.reshape(-1, k), w, out_dtype=out_dtype)
    return y.reshape(*lead, w.n)


def quantized_matmul(
    x: jax.Array,
    w: QuantizedWeight,
    *,
    out_dtype=None,
    backend: str | None = None,
    interpret: bool = False,
    **tiling: Knob | None,
) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N], every row bitwise independent of the other rows.
    ``backend`` None picks by ``jax.default_backend()``."""
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    return _matmul(x, w, out_dtype, _backend.target(backend, interpret, tiling))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _ste(x, w_master, fmt, group_size, out_dtype, target, quantizer):
    return _matmul(x, quantizer(w_master, fmt, group_size), out_dtype, target)


def _ste_fwd(x, w_master, fmt, group_size, out_dtype, target, quantizer):
    wq = quantizer(w_master, fmt, group_size)
    return _matmul(x, wq, out_dtype, target), (x, w_master, wq)


def _ste_bwd(fmt, group_size, out_dtype, target, quantizer, res, g):
    x, w_master, wq = res
    k, n = w_master.shape
    w = dequantize(wq, jnp.float32)
    g2 = g.reshape(-1, n).astype(jnp.float32)
    x2 = x.reshape(-1, k).astype(jnp.float32)
    dx = jnp.matmul(g2, w.T, precision=lax.Precision.HIGHEST)
    dw = jnp.matmul(x2.T, g2, precision=lax.Precision.HIGHEST)
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w_master.dtype)


_ste.defvjp(_ste_fwd, _ste_bwd)


def quantized_matmul_ste(
    x: jax.Array,
    w_master: jax.Array,
    fmt: str,
    group_size: int | None = None,
    *,
    out_dtype=None,
    backend: str | None = None,
    interpret: bool = False,
    quantizer: Quantizer = quantize,
    **tiling: Knob | None,
) -> jax.Array:
    """x [..., K] @ quantizer(w_master [K, N], fmt, group_size), differentiable in x and w_master."""
    if w_master.ndim != 2:
        raise ValueError(f"w_master must be [K, N], got shape {w_master.shape}")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    target = _backend.target(backend, interpret, tiling)
    return _ste(x, w_master, fmt, group_size, out_dtype, target, quantizer)
