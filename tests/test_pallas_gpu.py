"""GPU (Pallas-Triton) kernels, checked without a GPU: Triton lowering for CUDA, and the same kernels
in Pallas interpret mode against reference_matmul and for row-wise batch invariance."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import MatmulCases, f32_bound, one_program, random_weight
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


KNOBS = {  # the decode knobs: fixed split-K (partials summed in split order), swapped operands,
    # integer dots through bf16
    "split2": dict(split_k=2),
    "split4-swap-bf16dot": dict(split_k=4, swap_ab=True, int_dot="bf16"),
}
PREFIXES = {"": (1, 16, 17), **dict.fromkeys(KNOBS, (1, 17))}  # a part block, a whole one, one past it


@functools.cache
def dense_runs(fmt: str) -> dict[str, dict[str, np.ndarray]]:
    """Every interpreted dense call this module checks for ``fmt``, in one program (see
    pallas_cases): for the test tiling ("") and each knob set, 40 rows and their prefixes; for the
    test tiling also the rows permuted and row 0 among 7 other rows. Each is its own kernel launch
    at its own M."""
    x = acts(40, seed=3)
    perm = np.random.default_rng(0).permutation(40)
    other = acts(8, seed=4).at[3].set(x[0])

    def calls(x, xp, other, w):
        out = {}
        for name, prefixes in PREFIXES.items():
            mm = functools.partial(CASES.matmul, w=w, out_dtype=jnp.float32, **KNOBS.get(name, {}))
            out[name] = {"full": mm(x), **{f"m{m}": mm(x[:m]) for m in prefixes}}
        mm = functools.partial(CASES.matmul, w=w, out_dtype=jnp.float32)
        out[""].update(perm=mm(xp), other=mm(other))
        return out

    runs = one_program(calls, x, x[perm], other, weight(fmt))
    runs[""].update(x=np.asarray(x), perm_index=perm)
    return runs


@pytest.mark.parametrize("fmt", slow_but(["bf16", "w4a16", "w4a8", "fp8"], "w4a16"))
def test_float_formats_match_reference(fmt):
    runs, w = dense_runs(fmt)[""], weight(fmt)
    ref = reference_matmul(runs["x"], w)
    assert np.all(np.abs(runs["full"] - ref) <= f32_bound(runs["x"], w) + 1e-30)


def test_w8a8_is_exact_int32_accumulation():
    runs, w = dense_runs("w8a8")[""], weight("w8a8")
    xq, sx = (np.asarray(a) for a in formats.quantize_activations(jnp.asarray(runs["x"])))
    acc = xq.astype(np.int64) @ np.asarray(w.values, np.int64)
    want = (acc.astype(np.float32) * sx) * np.asarray(w.scales)
    np.testing.assert_array_equal(runs["full"], want)
    np.testing.assert_allclose(runs["full"], reference_matmul(runs["x"], w), rtol=1e-6, atol=1e-6)


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
    runs = dense_runs(fmt)[""]
    full = runs["full"]
    for m in PREFIXES[""]:
        np.testing.assert_array_equal(runs[f"m{m}"], full[:m])
    np.testing.assert_array_equal(runs["perm"], full[runs["perm_index"]])
    np.testing.assert_array_equal(runs["other"][3], full[0])


@pytest.mark.slow
def test_invariance_check_can_fail():
    """Negative control: another K tiling changes the summation order, and the bits show it."""
    by_32, by_128 = one_program(
        lambda x, w: [CASES.matmul(x, w, out_dtype=jnp.float32, block_k=bk) for bk in (32, 128)],
        acts(16, seed=5),
        weight("bf16"),
    )
    assert not np.array_equal(by_32, by_128)


def grouped(x, w, sizes, **kw):
    """The interpreted grouped kernel (the test tiling, ``kw`` over it), f32 out."""
    return CASES.grouped(x, w, sizes, out_dtype=jnp.float32, **kw)


@pytest.mark.parametrize("fmt", slow_but(formats.FORMATS, "w4a16"))
def test_grouped_matches_reference_and_is_invariant(fmt):
    w = weight(fmt, shape=(4, K, N), seed=7)
    sizes = [7, 0, 20, 5]
    x = acts(35, seed=8)  # 3 rows past the groups
    # expert 2's rows, behind a different number of expert-0 rows and different neighbours
    x2 = jnp.concatenate([acts(18, seed=9), x[7:27], acts(2, seed=10)])
    y, y2 = one_program(lambda x, x2, w: (grouped(x, w, sizes), grouped(x2, w, [18, 0, 20, 2])), x, x2, w)
    ref = CASES.grouped_reference(x, w, sizes)
    tol = 1e-5 if fmt == "w8a8" else K * 2.0**-23 * 4
    np.testing.assert_allclose(y, ref, rtol=tol, atol=tol)
    assert np.all(y[32:] == 0)
    np.testing.assert_array_equal(y2[18:38], y[7:27])


GROUP_TILES = jax.jit(group_tiles, static_argnums=(1, 2))


@pytest.mark.parametrize("sizes", [[0, 0, 0], [16, 0, 0], [1, 1, 30], [3, 13, 16]])
def test_group_tiles_cover_each_row_once(sizes):
    m, bm = 40, 16
    e, rb, lo, hi = (np.asarray(a) for a in GROUP_TILES(jnp.asarray(sizes, jnp.int32), m, bm))
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
    odd = formats.QuantizedWeight(jnp.zeros((48, N), jnp.int8), jnp.ones((2, N)), "w4a16", 48)
    with pytest.raises(ValueError, match="group size"):
        CASES.matmul(acts(2, k=96), odd)
    with pytest.raises(ValueError, match=r"\[E, K, N\]"):
        CASES.grouped(acts(2), w, [2])
    w3 = weight("w8a8", shape=(2, K, N))
    with pytest.raises(ValueError, match="group_sizes"):
        CASES.grouped(acts(2), w3, [2, 0, 0])


@pytest.mark.parametrize("fmt", slow_but(formats.FORMATS, "w4a16"))
@pytest.mark.parametrize("knobs", KNOBS)
def test_decode_knobs_match_reference_and_keep_rows_invariant(fmt, knobs):
    """Fixed split-K (partials summed in split order), swapped operands, integer dots through bf16."""
    runs, w = dense_runs(fmt), weight(fmt)
    x, full = runs[""]["x"], runs[knobs]["full"]
    if fmt == "w8a8":
        np.testing.assert_array_equal(full, runs[""]["full"])  # int32 accumulation: tiling cannot matter
    else:
        assert np.all(np.abs(full - reference_matmul(x, w)) <= f32_bound(x, w) + 1e-30)
    for m in PREFIXES[knobs]:
        np.testing.assert_array_equal(runs[knobs][f"m{m}"], full[:m])


@pytest.mark.slow
def test_int4_group_longer_than_a_step():
    """Groups spanning several K steps (inner loop over chunks of one group) stay exact-ish and invariant."""
    w = random_weight("w4a16", (K, N), 6, jnp.float32, 128)  # one group over all of K, block_k 32: 4 chunks
    x = acts(20, seed=2)
    mm = functools.partial(CASES.matmul, out_dtype=jnp.float32, block_k=32, split_k=1)
    full, one = one_program(lambda x, w: (mm(x, w), mm(x[:1], w)), x, w)
    ref = reference_matmul(np.asarray(x), w)
    assert np.all(np.abs(full - ref) <= f32_bound(x, w) + 1e-30)
    np.testing.assert_array_equal(one, full[:1])


@pytest.mark.parametrize("fmt", slow_but(["w8a8", "w4a16", "fp8"], "w4a16"))
def test_decode_knobs_lower_for_cuda(fmt):
    x, w = acts(16, dtype=jnp.bfloat16), weight(fmt, dtype=jnp.bfloat16)
    knobs = KNOBS["split4-swap-bf16dot"]
    assert CASES.lowers(lambda x, w: CASES.matmul(x, w, interpret=False, **knobs), x, w)


def test_gpu_blocks_fill_the_sms_and_read_the_tuned_table(monkeypatch):
    for fmt in formats.FORMATS:
        b = gm.gpu_blocks(fmt, 4096, 4096)
        assert (4096 // b.block_n) * b.split_k >= 128 and b.block_m == 16
    monkeypatch.setitem(tuned.TUNED, ("w4a16", 4096, 4096), dict(block_n=32, split_k=2, swap_ab=True))
    b = gm.gpu_blocks("w4a16", 4096, 4096)
    assert (b.block_n, b.split_k, b.swap_ab, b.block_k) == (32, 2, True, 256)
    assert gm.gpu_blocks("w4a16", 4096, 8192).block_n == 128  # other shapes untouched
