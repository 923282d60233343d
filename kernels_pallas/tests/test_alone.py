"""kernels_pallas on its own (``pip install ./kernels_pallas pytest``; ``pytest kernels_pallas/tests``),
on the CPU path: every op against its float64 (or plain XLA) reference, and the invariance contract,
a row's bits the same alone and inside any batch. Imports nothing but kernels_pallas, JAX, numpy and
pytest; the main project's suite (``tests/test_kernels_*.py``) goes much further."""

from __future__ import annotations

import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from kernels_pallas import attention, rowwise

K, N = 256, 48
GROUP = {"bf16": None, "w8a8": None, "w4a16": 64, "w4a8": 64, "fp8": None}


def normal(shape, seed, dtype=jnp.float32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32).astype(dtype)


def test_imports_no_qarl_jax():
    assert not any(name == "qarl_jax" or name.startswith("qarl_jax.") for name in sys.modules)


@pytest.mark.parametrize("fmt", kp.FORMATS)
def test_matmul_within_k_ulps_of_float64_and_rows_invariant(fmt):
    w = kp.quantize(normal((K, N), 1), fmt, GROUP[fmt])
    x = normal((29, K), 2)
    y = np.asarray(kp.quantized_matmul(x, w, out_dtype=jnp.float32), np.float64)
    ref = kp.reference_matmul(np.asarray(x), w)
    xs = np.asarray(x, np.float64)
    if kp.formats.ACT_BITS[fmt] == 8:  # the reference sees the quantized activations too
        q, s = kp.quantize_activations(x, fmt)
        xs = np.asarray(q, np.float64) * np.asarray(s, np.float64)
    bound = K * 2.0**-23 * (np.abs(xs) @ np.abs(np.asarray(kp.dequantize(w), np.float64)))
    assert np.all(np.abs(y - ref) <= bound)
    for r in (0, 13, 28):
        alone = kp.quantized_matmul(x[r : r + 1], w, out_dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(alone)[0], y[r].astype(np.float32))


def test_grouped_matmul_matches_reference_whatever_the_other_experts():
    e = 3
    w = kp.quantize(normal((e, K, N), 3), "w4a16", 64)
    x = normal((12, K), 4)
    sizes = jnp.asarray([5, 0, 7], jnp.int32)
    y = np.asarray(kp.grouped_matmul(x, w, sizes), np.float64)
    np.testing.assert_allclose(y, kp.reference_grouped_matmul(np.asarray(x), w, np.asarray(sizes)), atol=1e-3)
    # expert 2's rows alone (the other experts given no rows) keep their bits
    alone = kp.grouped_matmul(x[5:], w, jnp.asarray([0, 0, 7], jnp.int32))
    np.testing.assert_array_equal(np.asarray(alone), y[5:].astype(np.float32))


def test_attention_matches_float64_and_a_decode_step_keeps_the_bits():
    b, t, h, kv, d = 1, 9, 4, 2, 32
    q, k, v = normal((b, t, h, d), 5), normal((b, t, kv, d), 6), normal((b, t, kv, d), 7)
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    full = attention.attention(q, k, v, positions)
    ref = np.asarray(attention.reference_attention_f64(q, k, v, positions))
    np.testing.assert_allclose(np.asarray(full, np.float64), ref, atol=1e-5)
    for p in (0, 4, 8):  # one query over the whole cache (later keys masked by position)
        step = attention.attention(q[:, p : p + 1], k, v, positions[:, p : p + 1])
        np.testing.assert_array_equal(np.asarray(step)[:, 0], np.asarray(full)[:, p])


def test_rowwise_ops_match_references_and_rows_are_invariant():
    x = normal((10, 64), 8)
    w = normal((64,), 9)
    norm = rowwise.rms_norm(x, w, 1e-6)
    np.testing.assert_allclose(
        np.asarray(norm), np.asarray(rowwise.reference_rms_norm(x, w, 1e-6)), atol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(rowwise.rms_norm(x[3:4], w, 1e-6))[0], np.asarray(norm)[3])

    heads = normal((10, 2, 32), 10)
    pos = jnp.arange(10, dtype=jnp.int32) * 7
    rot = rowwise.rope(heads, pos, 1e4)
    np.testing.assert_allclose(
        np.asarray(rot), np.asarray(rowwise.reference_rope(heads, pos, 1e4)), atol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(rowwise.rope(heads[6:7], pos[6:7], 1e4))[0], np.asarray(rot)[6])

    logits = normal((10, 100), 11) * 3
    targets = jnp.asarray(np.random.default_rng(12).integers(0, 100, 10), jnp.int32)
    lp = rowwise.token_logprobs(logits, targets, 0.7)
    full = rowwise.log_softmax(logits, 0.7)
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(full)[np.arange(10), np.asarray(targets)])
    np.testing.assert_allclose(
        np.asarray(rowwise.logsumexp(logits, 0.7)),
        np.asarray(rowwise.reference_logsumexp(logits, 0.7)),
        atol=1e-5,
    )
    np.testing.assert_array_equal(
        np.asarray(rowwise.token_logprobs(logits[2:3], targets[2:3], 0.7))[0], lp[2]
    )


def test_the_readme_example_runs():
    """The README's example, as printed: the frozen and the straight-through matmul give the same bits."""
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    names: dict = {}
    exec(code, names)
    assert names["y"].shape == (16, 512) and names["o"].shape == (1, 8, 4, 64)
    np.testing.assert_array_equal(np.asarray(names["y"], np.float32), np.asarray(names["y_ste"], np.float32))
