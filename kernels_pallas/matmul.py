"""Public quantized matmul: operand checks and the one place a backend is chosen.

CPU runs the plain-JAX row-block path (:mod:`kernels_pallas.cpu_matmul`); GPU and TPU run the
Pallas kernels of ``kernels_pallas.gpu.matmul`` / ``kernels_pallas.tpu.matmul``, imported lazily
so this module stays importable where those are absent.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from kernels_pallas import cpu_matmul
from kernels_pallas.formats import WEIGHT_BITS, QuantizedWeight, check_format

ACTIVATION_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
BACKENDS = ("cpu", "gpu", "tpu")


def check_activations(x: jax.Array, name: str = "x") -> None:
    if jnp.dtype(x.dtype) not in ACTIVATION_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")


def check_weight(w: QuantizedWeight, ndim: int) -> None:
    """Raise on a weight whose format, rank or scale shape does not match the data contract."""
    if not isinstance(w, QuantizedWeight):
        raise TypeError(f"expected a QuantizedWeight, got {type(w).__name__} (use kernels_pallas.quantize)")
    check_format(w.fmt)
    if w.values.ndim != ndim:
        raise ValueError(f"expected a weight of rank {ndim}, got values of shape {w.values.shape}")
    bits = WEIGHT_BITS[w.fmt]
    if bits is None:
        check_activations(w.values, "bf16-format weight values")
        return
    if w.values.dtype != jnp.int8:
        raise TypeError(f"{w.fmt} weight values must be int8, got {w.values.dtype}")
    if w.k % w.group_size:
        raise ValueError(f"{w.fmt}: K={w.k} is not a multiple of the group size {w.group_size}")
    want = (*w.values.shape[:-2], w.k // w.group_size, w.n)
    if w.scales is None or w.scales.shape != want:
        got = None if w.scales is None else w.scales.shape
        raise ValueError(f"{w.fmt} scales must have shape {want}, got {got}")


def resolve_backend(backend: str | None) -> str:
    backend = jax.default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    return backend


def _accelerator_matmul(backend: str):
    try:
        return importlib.import_module(f"kernels_pallas.{backend}.matmul").matmul
    except (ImportError, AttributeError) as err:
        raise RuntimeError(
            f"no {backend} quantized matmul: kernels_pallas.{backend}.matmul.matmul is unavailable "
            f"({err}); pass backend='cpu' to force the plain-JAX path"
        ) from err


def quantized_matmul(
    x: jax.Array,
    w: QuantizedWeight,
    *,
    out_dtype=None,
    block_rows: int | None = None,
    backend: str | None = None,
) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N], every row bitwise independent of the other rows.

    ``backend`` None picks by ``jax.default_backend()``; ``block_rows`` (CPU only) defaults to a
    function of (K, N)."""
    check_activations(x)
    check_weight(w, ndim=2)
    if x.ndim < 1 or x.shape[-1] != w.k:
        raise ValueError(f"x has shape {x.shape}; its last dimension must be K={w.k}")
    out_dtype = x.dtype if out_dtype is None else jnp.dtype(out_dtype)
    *lead, k = x.shape
    x2d = x.reshape(-1, k)
    backend = resolve_backend(backend)
    if backend == "cpu":
        y = cpu_matmul.matmul(x2d, w, out_dtype=out_dtype, block_rows=block_rows)
    else:
        y = _accelerator_matmul(backend)(x2d, w, out_dtype=out_dtype, interpret=False)
    return y.reshape(*lead, w.n)
