"""GPU (Pallas-Triton) kernels, checked without a GPU: Triton lowering for CUDA, and the same kernels
in Pallas interpret mode against reference_matmul and for row-wise batch invariance."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import MatmulCases, f32_bound
from tiers import slow_but

from kernels_pallas import formats
from kernels_pallas.grouped.common import group_tiles
from kernels_pallas.matmul import gpu as gm
from kernels_pallas.matmul import tuned
from kernels_pallas.matmul.reference import reference_matmul

K, N = 128, 64
BLK = dict(block_n=32, block_k=64)  # two N blocks, two K steps (w4a16 at group 32: 4 groups)
CASES = MatmulCases("gpu", K, N, group=32, blocks=BLK)
weight, acts, run = CASES.weight, CASES.acts, CASES.run


@pytest.mark.parametrize("fmt", slow_but(formats.FORMATS, "w4a16"))
def test_lowers_for_cuda_through_triton(fmt):
    x, w = acts(16, dtype=jnp.bfloat16), weight(fmt, dtype=jnp.bfloat16)
    assert CASES.lowers(lambda x, w: CASES.matmul(x, w, interpret=False), x, w)  # Triton, not Mosaic GPU


@pytest.mark.parametrize("fmt", slow_but(formats.FORMATS, "w4a16"))
def test_grouped_lowers_for_cuda_through_triton(fmt):
    x, w = acts(24, dtype=jnp.bfloat16), weight(fmt, shape=(3, K, N), dtype=jnp.bfloat16)
    sizes = jnp.array([5, 0, 19], jnp.int32)
    assert CASES.lowers(lambda x, w, s: CASES.grouped(x, w, s, interpret=False), x, w, sizes)


@pytest.mark.parametrize("fmt", slow_but(["bf16", "w4a16", "w4a8", "fp8"], "w4a16"))
def test_float_formats_match_reference(fmt):
    x, w = acts(5), weight(fmt)
    y = run(x, w)
    ref = reference_matmul(np.asarray(x), w)
    assert np.all(np.abs(y - ref) <= f32_bound(x, w) + 1e-30)


def test_w8a8_is_exact_int32_accumulation():
    x, w = acts(5), weight("w8a8")
    y = run(x, w)
    xq, sx = (np.asarray(a) for a in formats.quantize_activations(x))
    acc = xq.astype(np.int64) @ np.asarray(w.values, np.int64)
    want = (acc.astype(np.float32) * sx) * np.asarray(w.scales)
    np.testing.assert_array_equal(y, want)
    np.testing.assert_allclose(y, reference_matmul(np.asarray(x), w), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_bf16_activations_and_output_dtype():
    CASES.assert_bf16_in_bf16_out()


@pytest.mark.slow
def test_padding_of_n_and_k():
    """N and K that no power-of-two block divides are padded, not mis-tiled."""
    x = acts(3, k=72)
    w = formats.quantize(jax.random.normal(jax.random.key(2), (72, 40)), "w8a8")
    y = run(x, w, block_n=32, block_k=32)
    np.testing.assert_allclose(y, reference_matmul(np.asarray(x), w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", slow_but(formats.FORMATS, "w4a16"))
def test_rows_bitwise_invariant_to_m_and_neighbours(fmt):
    w = weight(fmt)
    x = acts(40, seed=3)
    full = run(x, w)
    for m in (1, 16, 17):  # a part block, a whole one, one past it
        np.testing.assert_array_equal(run(x[:m], w), full[:m])
    perm = np.random.default_rng(0).permutation(40)
    np.testing.assert_array_equal(run(x[perm], w), full[perm])
    other = acts(8, seed=4).at[3].set(x[0])
    np.testing.assert_array_equal(run(other, w)[3], full[0])


@pytest.mark.slow
def test_invariance_check_can_fail():
    """Negative control: another K tiling changes the summation order, and the bits show it."""
    w = weight("bf16")
    x = acts(16, seed=5)
    assert not np.array_equal(run(x, w, block_k=32), run(x, w, block_k=128))


def grouped_reference(x, w, sizes):
    starts = np.concatenate([[0], np.cumsum(sizes)])
    ref = np.zeros((x.shape[0], w.n))
    for e in range(len(sizes)):
        rows = slice(starts[e], starts[e + 1])
        ref[rows] = reference_matmul(np.asarray(x[rows]), jax.tree.map(lambda a, e=e: a[e], w))
    return ref


def run_grouped(x, w, sizes, **kw):
    return np.asarray(CASES.grouped(x, w, sizes, out_dtype=jnp.float32, **kw))


@pytest.mark.parametrize("fmt", slow_but(formats.FORMATS, "w4a16"))
def test_grouped_matches_reference_and_is_invariant(fmt):
    w = weight(fmt, shape=(4, K, N), seed=7)
    sizes = [7, 0, 20, 5]
    x = acts(35, seed=8)  # 3 rows past the groups
    y = run_grouped(x, w, sizes)
    ref = grouped_reference(x, w, sizes)
    tol = 1e-5 if fmt == "w8a8" else K * 2.0**-23 * 4
    np.testing.assert_allclose(y, ref, rtol=tol, atol=tol)
    assert np.all(y[32:] == 0)
    # expert 2's rows, behind a different number of expert-0 rows and different neighbours
    y2 = run_grouped(jnp.concatenate([acts(18, seed=9), x[7:27], acts(2, seed=10)]), w, [18, 0, 20, 2])
    np.testing.assert_array_equal(y2[18:38], y[7:27])


@pytest.mark.parametrize("sizes", [[0, 0, 0], [16, 0, 0], [1, 1, 30], [3, 13, 16]])
def test_group_tiles_cover_each_row_once(sizes):
    m, bm = 40, 16
    e, rb, lo, hi = (np.asarray(a) for a in group_tiles(jnp.asarray(sizes, jnp.int32), m, bm))
    assert len(e) == 3 + 3 - 1 and np.all(np.diff(rb) >= 0)
    owner = np.full(m, -1)
    for t in range(len(e)):
        assert lo[t] == hi[t] or rb[t] * bm <= lo[t] < hi[t] <= (rb[t] + 1) * bm
        assert np.all(owner[lo[t] : hi[t]] == -1)
        owner[lo[t] : hi[t]] = e[t]
    want = np.concatenate([np.full(s, i) for i, s in enumerate(sizes)] + [np.full(m - sum(sizes), -1)])
    np.testing.assert_array_equal(owner, want)
    assert set(rb) >= set(range(-(-m // bm)))  # every row block is visited (TPU zeroes it)


def test_errors_are_clear():
    w = weight("w4a16")
    with pytest.raises(ValueError, match="K=128"):
        CASES.matmul(acts(2, k=64), w)
    with pytest.raises(TypeError, match="floating"):
        CASES.matmul(jnp.ones((2, K), jnp.int32), w)
    with pytest.raises(ValueError, match="power-of-two"):
        CASES.matmul(acts(2), w, block_n=48)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        CASES.matmul(acts(2), jnp.ones((K, N)))
    odd = formats.quantize(jax.random.normal(jax.random.key(0), (96, N)), "w4a16", 48)
    with pytest.raises(ValueError, match="group size"):
        CASES.matmul(acts(2, k=96), odd)
    with pytest.raises(ValueError, match=r"\[E, K, N\]"):
        CASES.grouped(acts(2), w, [2])
    w3 = weight("w8a8", shape=(2, K, N))
    with pytest.raises(ValueError, match="group_sizes"):
        CASES.grouped(acts(2), w3, [2, 0, 0])


KNOBS = [
    dict(split_k=2),
    dict(split_k=4, swap_ab=True, int_dot="bf16"),
]


@pytest.mark.parametrize("fmt", slow_but(formats.FORMATS, "w4a16"))
@pytest.mark.parametrize("knobs", KNOBS, ids=["split2", "split4-swap-bf16dot"])
def test_decode_knobs_match_reference_and_keep_rows_invariant(fmt, knobs):
    """Fixed split-K (partials summed in split order), swapped operands, integer dots through bf16."""
    w = weight(fmt)
    x = acts(40, seed=3)
    full = run(x, w, **knobs)
    ref = reference_matmul(np.asarray(x[:5]), w)
    if fmt == "w8a8":
        np.testing.assert_array_equal(full, run(x, w))  # int32 accumulation: tiling cannot matter
    else:
        assert np.all(np.abs(full[:5] - ref) <= f32_bound(x[:5], w) + 1e-30)
    for m in (1, 17):
        np.testing.assert_array_equal(run(x[:m], w, **knobs), full[:m])


@pytest.mark.slow
def test_int4_group_longer_than_a_step():
    """Groups spanning several K steps (inner loop over chunks of one group) stay exact-ish and invariant."""
    wf = jax.random.normal(jax.random.key(6), (K, N), jnp.float32) * 0.1
    w = formats.quantize(wf, "w4a16", 128)  # one group over all of K, block_k 32: 4 chunks
    x = acts(20, seed=2)
    full = run(x, w, block_k=32, split_k=1)
    ref = reference_matmul(np.asarray(x), w)
    assert np.all(np.abs(full - ref) <= f32_bound(x, w) + 1e-30)
    np.testing.assert_array_equal(run(x[:1], w, block_k=32, split_k=1), full[:1])


@pytest.mark.parametrize("fmt", slow_but(["w8a8", "w4a16", "fp8"], "w4a16"))
def test_decode_knobs_lower_for_cuda(fmt):
    x, w = acts(16, dtype=jnp.bfloat16), weight(fmt, dtype=jnp.bfloat16)
    assert CASES.lowers(lambda x, w: CASES.matmul(x, w, interpret=False, **KNOBS[1]), x, w)


def test_gpu_blocks_fill_the_sms_and_read_the_tuned_table(monkeypatch):
    for fmt in formats.FORMATS:
        b = gm.gpu_blocks(fmt, 4096, 4096)
        assert (4096 // b.block_n) * b.split_k >= 128 and b.block_m == 16
    monkeypatch.setitem(tuned.TUNED, ("w4a16", 4096, 4096), dict(block_n=32, split_k=2, swap_ab=True))
    b = gm.gpu_blocks("w4a16", 4096, 4096)
    assert (b.block_n, b.split_k, b.swap_ab, b.block_k) == (32, 2, True, 256)
    assert gm.gpu_blocks("w4a16", 4096, 8192).block_n == 128  # other shapes untouched
