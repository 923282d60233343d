"""Shared set-up of the GPU and TPU kernel tests (run without either device: lowering for the
platform, and the kernels in Pallas' interpreter through the public API).

Cost: each interpreted call is compiled by XLA:CPU, and most of a small kernel's compile is the
fixed cost of a program (measured: ~0.35 s CPU a program, ~0.2 s more per kernel in it). So a
test's calls run as ONE jitted program (:func:`one_program`): every call is still its own kernel
launch at its own M, tiling and knobs, whose bits the test compares; only the compile is shared.
Random weights are made once per (format, shape, seed) by one jitted program, not op by op."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas as kp
from kernels_pallas import formats
from kernels_pallas.matmul.reference import reference_matmul

# backend -> (lowering platform, the custom call its kernels lower to)
PLATFORM = {"gpu": ("cuda", "__gpu$xla.gpu.triton"), "tpu": ("tpu", "tpu_custom_call")}


def lowered_text(backend: str, fn, *args) -> str:
    """``fn(*args)`` jitted and lowered for ``backend``'s platform, as text."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(PLATFORM[backend][0],)).as_text()


def lowers(backend: str, fn, *args) -> bool:
    """Whether ``fn(*args)`` lowers to the backend's Pallas custom call."""
    return PLATFORM[backend][1] in lowered_text(backend, fn, *args)


def one_program(fn: Callable[..., Any], *args) -> Any:
    """``fn(*args)`` jitted as one program (its arrays passed as arguments, never baked in as
    constants), every output leaf as a numpy array."""
    return jax.tree.map(np.asarray, jax.jit(fn)(*args))


@functools.cache
def random_weight(
    fmt: str, shape: tuple[int, ...], seed: int, dtype, group: int | None
) -> formats.QuantizedWeight:
    """N(0, 0.1) weights of ``shape`` quantized into ``fmt`` (bf16: cast to ``dtype``), made by one
    jitted program and kept for the session (a test's reference is computed from the weight it is
    given, so any weight serves)."""
    return _make_weight(fmt, shape, seed, dtype, group)


@functools.partial(jax.jit, static_argnums=(0, 1, 3, 4))
def _make_weight(fmt, shape, seed, dtype, group) -> formats.QuantizedWeight:
    w = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 0.1
    return formats.quantize(w.astype(dtype) if fmt == "bf16" else w, fmt, group)


def f32_bound(x, w: formats.QuantizedWeight) -> np.ndarray:
    """The f32 accumulation error bound K * 2^-23 * (|x| @ |W|) of ``x @ w``, with x the
    activations the kernel multiplies: quantized per token (values times scales) for the a8 formats."""
    xa = np.asarray(x, np.float64)
    if formats.ACT_BITS[w.fmt] == 8:
        q, s = formats.quantize_activations(jnp.asarray(x, jnp.float32), w.fmt)
        xa = np.asarray(q, np.float64) * np.asarray(s, np.float64)
    return w.k * 2.0**-23 * (np.abs(xa) @ np.abs(np.asarray(formats.dequantize(w), np.float64)))


@dataclasses.dataclass(frozen=True)
class MatmulCases:
    """Random operands of one shape, and the backend's matmul kernels in the interpreter."""

    backend: str
    k: int
    n: int
    group: int  # int4 group size
    blocks: dict

    def weight(self, fmt: str, shape=None, seed: int = 1, dtype=jnp.float32) -> formats.QuantizedWeight:
        group = self.group if formats.WEIGHT_BITS[fmt] == 4 else None
        dtype = dtype if fmt == "bf16" else jnp.float32  # the others quantize f32 weights
        return random_weight(fmt, tuple(shape or (self.k, self.n)), seed, dtype, group)

    def acts(self, m: int, seed: int = 0, dtype=jnp.float32, k: int | None = None) -> jax.Array:
        return jax.random.normal(jax.random.key(seed), (m, k or self.k), dtype)

    def matmul(self, x, w, **kw):
        """The backend's kernel, interpreted, with the test tiling (``kw`` overrides it)."""
        kw = {"backend": self.backend, "interpret": True, **self.blocks, **kw}
        return kp.quantized_matmul(x, w, **kw)

    def run(self, x, w, **kw) -> np.ndarray:
        return np.asarray(self.matmul(x, w, out_dtype=jnp.float32, **kw))

    def grouped(self, x, w, sizes, **kw):
        kw = {"backend": self.backend, "interpret": True, **self.blocks, **kw}
        return kp.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), **kw)

    def grouped_reference(self, x, w: formats.QuantizedWeight, sizes) -> np.ndarray:
        """float64 reference of the grouped matmul: each expert's rows through reference_matmul,
        rows past the groups zero."""
        starts = np.concatenate([[0], np.cumsum(sizes)])
        ref = np.zeros((x.shape[0], w.n))
        for e in range(len(sizes)):
            rows = slice(starts[e], starts[e + 1])
            expert = jax.tree.map(lambda a, e=e: np.asarray(a)[e], w)
            ref[rows] = reference_matmul(np.asarray(x[rows]), expert)
        return ref

    def lowers(self, fn, *args) -> bool:
        """``fn(x, w, ...)`` lowered with the backend's (compiled, not interpreted) kernels."""
        return lowers(self.backend, fn, *args)

    def assert_bf16_in_bf16_out(self) -> None:
        """bf16 activations give a bf16 output by default, near the float64 reference."""
        x, w = self.acts(3, dtype=jnp.bfloat16), self.weight("w4a16")
        y = self.matmul(x, w)
        assert y.dtype == jnp.bfloat16 and y.shape == (3, self.n)
        ref = reference_matmul(np.asarray(x.astype(jnp.float32)), w)
        np.testing.assert_allclose(np.asarray(y, np.float64), ref, rtol=2e-2, atol=2e-2)
