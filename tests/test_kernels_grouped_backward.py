"""The grouped STE backward: ragged_dot's gradients on the dequantized weight over many row blocks
(blocks spanning several experts, empty experts, rows past the groups), and O(rows) compiled
memory (no experts x rows temporary)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import kernels_pallas as kp
from kernels_pallas.grouped.backward import grouped_backward


@pytest.mark.parametrize("fmt, sizes", [("w4a16", [5, 0, 13, 1, 9, 0]), ("w8a8", [37, 0, 0, 0, 0, 0])])
def test_blocked_backward_matches_ragged_dot(fmt, sizes):
    m, k, n = 40, 64, 24  # sum(sizes) = 28 or 37 < 40: the last rows belong to no expert
    keys = jax.random.split(jax.random.key(0), 3)
    x, g = jax.random.normal(keys[0], (m, k)), jax.random.normal(keys[1], (m, n))
    wq = kp.quantize(jax.random.normal(keys[2], (len(sizes), k, n)), fmt, 32 if fmt == "w4a16" else None)
    sizes = jnp.asarray(sizes, jnp.int32)

    def ragged(x, w):
        return lax.ragged_dot(x, w, sizes, precision=lax.Precision.HIGHEST)

    _, vjp = jax.vjp(ragged, x, kp.dequantize(wq))
    want_dx, want_dw = vjp(g)
    for block_rows in (4, 7, 256):
        dx, dw = jax.jit(lambda x, g, b=block_rows: grouped_backward(x, g, wq, sizes, block_rows=b))(x, g)
        np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-4)
        assert not np.any(np.asarray(dx[int(sizes.sum()) :]))


def test_compiled_grouped_backward_holds_no_expert_expansion():
    """4,096 rows over 64 experts: ragged_dot's transpose on CPU allocates experts x rows x width
    (here 64 x 4096 x 128 f32 = 128 MiB); the blocked backward's largest array is the weight
    gradient itself and its temporaries stay under 16 MiB."""
    m, k, n, e = 4096, 128, 128, 64
    x = jax.ShapeDtypeStruct((m, k), jnp.float32)
    w = jax.ShapeDtypeStruct((e, k, n), jnp.float32)
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32)

    def loss(x, w, sizes):
        return jnp.sum(kp.grouped_matmul_ste(x, w, sizes, "w4a16", 32))

    compiled = jax.jit(jax.grad(loss, (0, 1))).lower(x, w, sizes).compile()
    shapes = re.findall(r"\b(?:f32|bf16|s32|s8|pred)\[([0-9,]+)\]", compiled.as_text())
    assert max(math.prod(int(d) for d in s.split(",")) for s in shapes) == e * k * n
    assert compiled.memory_analysis().temp_size_in_bytes < 16 * 2**20
