"""Grouped (MoE) quantized matmul: accuracy, per-token invariance, equality with the dense kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import slow_but

import kernels_pallas as kp
from kernels_pallas.grouped import expert_weight
from kernels_pallas.grouped.cpu import group_layout

E, K, N = 4, 128, 40
GROUP = {"bf16": None, "w8a8": None, "w4a16": 32, "w4a8": 32, "fp8": None}


@functools.cache
def _weights(fmt, seed=0):
    """Quantized by one program, once per module; numpy leaves (so the references' per-expert
    slices compile nothing: op by op, each was a program)."""
    w = np.random.default_rng(seed).standard_normal((E, K, N)).astype(np.float32)
    return jax.tree.map(np.asarray, QUANTIZE(w, fmt, GROUP[fmt]))


QUANTIZE = jax.jit(kp.quantize, static_argnums=(1, 2))


def _x(m, seed):
    """Rows, numpy (slicing them compiles nothing)."""
    return np.random.default_rng(seed).standard_normal((m, K)).astype(np.float32)


def test_group_layout_one_expert_per_block():
    sizes = jnp.array([3, 0, 9, 1], jnp.int32)
    dest, block_expert, padded = group_layout(sizes, 14, 4)
    assert padded == 28  # round_up(14 + 4 * 3, 4)
    np.testing.assert_array_equal(dest, [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 16, 28])
    np.testing.assert_array_equal(block_expert[:5], [0, 2, 2, 2, 3])


@pytest.mark.parametrize("fmt", slow_but(kp.FORMATS, "w4a16"))
def test_grouped_matches_float64_reference(fmt):
    w = _weights(fmt, seed=1)
    x = _x(30, seed=2)
    sizes = jnp.array([7, 0, 15, 5], jnp.int32)  # 3 trailing rows belong to no expert
    y = np.asarray(kp.grouped_matmul(x, w, sizes), np.float64)
    ref = kp.reference_grouped_matmul(np.asarray(x), w, np.asarray(sizes))
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(kp.dequantize(w), np.float64)).max(0)
    assert np.all(np.abs(y - ref) <= K * 2.0**-23 * scale * 1.01)
    assert np.all(y[27:] == 0) and np.any(y[:27] != 0)


@pytest.mark.parametrize("fmt", slow_but(kp.FORMATS, "w4a16"))
def test_grouped_rows_equal_dense_kernel_bitwise(fmt):
    w = _weights(fmt, seed=3)
    x = _x(20, seed=4)
    sizes = jnp.array([2, 9, 0, 9], jnp.int32)
    y = np.asarray(kp.grouped_matmul(x, w, sizes, block_rows=8))
    expert = np.repeat(np.arange(E), np.asarray(sizes))
    for r in (0, 1, 2, 10, 19):
        dense = kp.quantized_matmul(x[r : r + 1], expert_weight(w, int(expert[r])), block_rows=8)
        np.testing.assert_array_equal(y[r], np.asarray(dense)[0])


@pytest.mark.parametrize("fmt", slow_but(kp.FORMATS, "w4a16"))
@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    m=st.sampled_from((1, 12, 40)),
    expert=st.integers(0, E - 1),
    cuts=st.lists(st.integers(0, 40), min_size=E - 1, max_size=E - 1),
    pos=st.integers(0, 39),
    seed=st.integers(0, 2**16),
)
def test_grouped_token_bitwise_invariant(fmt, m, expert, cuts, pos, seed):
    """A token's output is the same bits alone or inside any sorted batch of any group sizes."""
    w = _weights(fmt, seed=5)
    token = _x(1, seed)
    alone = kp.grouped_matmul(token, w, np.eye(E, dtype=np.int32)[expert], block_rows=8)
    bounds = np.sort(np.minimum(np.asarray(cuts), m))
    sizes = np.diff(np.concatenate([[0], bounds, [m]]))
    if sizes[expert] == 0:  # give the token's expert a row, taken from a neighbour group
        donor = int(np.argmax(sizes))
        sizes[donor] -= 1
        sizes[expert] += 1
    start = int(sizes[:expert].sum())
    row = start + pos % int(sizes[expert])
    x = _x(m, seed + 1) * np.float32(10.0)
    x[row] = token[0]
    y = kp.grouped_matmul(x, w, sizes.astype(np.int32), block_rows=8)
    np.testing.assert_array_equal(np.asarray(y)[row], np.asarray(alone)[0])


def test_grouped_errors():
    w = _weights("w4a16")
    x = _x(4, 0)
    with pytest.raises(ValueError, match=r"group_sizes must be an integer array of shape \(4,\)"):
        kp.grouped_matmul(x, w, jnp.array([4, 0], jnp.int32))
    with pytest.raises(ValueError, match=r"group_sizes must be an integer array"):
        kp.grouped_matmul(x, w, jnp.ones(E, jnp.float32))
    with pytest.raises(ValueError, match="x must be"):
        kp.grouped_matmul(x[:, :64], w, jnp.ones(E, jnp.int32))
    with pytest.raises(ValueError, match="rank 3"):
        kp.grouped_matmul(x, kp.quantize(jnp.ones((K, N)), "w4a16"), jnp.ones(E, jnp.int32))
    with pytest.raises(TypeError, match="got int8"):
        kp.grouped_matmul(x.astype(jnp.int8), w, jnp.ones(E, jnp.int32))
