"""TPU (Pallas Mosaic) kernels, checked without a TPU: in Pallas' TPU interpret mode against
reference_matmul and for row-wise batch invariance. Sizes are tiny because the TPU interpreter is
slow. Their lowering for the TPU platform is not checked here: test_tpu_compile compiles every
kernel in every format with the real TPU compiler (lowering, then Mosaic), a stronger check. A
format's interpreted calls run as one program (see pallas_cases), each its own kernel launch at
its own M."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import MatmulCases, f32_bound, one_program
from tiers import slow_but

import kernels_pallas as kp
from kernels_pallas import formats
from kernels_pallas.matmul.reference import reference_matmul

K, N = 256, 256
BLK = dict(block_n=128, block_k=128)  # two N blocks, two K steps (int4 group 64: two groups a step)
CASES = MatmulCases("tpu", K, N, group=64, blocks=BLK)
weight, acts = CASES.weight, CASES.acts


PERM = np.random.default_rng(0).permutation(64)
GROUPS = [10, 0, 40]  # 20 rows past the groups come out zero
GROUPS_BEHIND = [35, 0, 40]  # expert 2's rows behind 35 rows of expert 0 instead of 10


@functools.cache
def tpu_runs(fmt: str) -> dict[str, np.ndarray]:
    """Every interpreted call this module checks for ``fmt``, in one program: the dense kernel on
    64 rows, on their first 1 and 33 (a part block, one past a block of 32) and on them permuted;
    the grouped kernel on 70 rows, and on expert 2's rows behind other rows."""
    x, xg = acts(64, seed=3), acts(70, seed=8)
    behind = jnp.concatenate([acts(35, seed=9), xg[10:50]])

    def calls(x, xp, w, xg, behind, wg):
        mm = functools.partial(CASES.matmul, w=w, out_dtype=jnp.float32)
        grouped = functools.partial(CASES.grouped, w=wg, out_dtype=jnp.float32)
        return {
            "full": mm(x),
            **{f"m{m}": mm(x[:m]) for m in (1, 33)},
            "perm": mm(xp),
            "grouped": grouped(xg, sizes=GROUPS),
            "behind": grouped(behind, sizes=GROUPS_BEHIND),
        }

    grouped_w = weight(fmt, shape=(3, K, N), seed=7)
    return one_program(calls, x, x[PERM], weight(fmt), xg, behind, grouped_w)


@pytest.mark.parametrize("fmt", slow_but(formats.FORMATS, "w4a16"))
def test_matches_reference_and_rows_are_invariant(fmt):
    runs, w, x = tpu_runs(fmt), weight(fmt), acts(64, seed=3)
    full = runs["full"]
    ref = reference_matmul(np.asarray(x), w)
    if fmt == "w8a8":  # exact int32 accumulation, then (acc * s_x) * s_w in f32
        xq, sx = (np.asarray(a) for a in formats.quantize_activations(x))
        acc = xq.astype(np.int64) @ np.asarray(w.values, np.int64)
        np.testing.assert_array_equal(full, (acc.astype(np.float32) * sx) * np.asarray(w.scales))
    else:
        assert np.all(np.abs(full - ref) <= f32_bound(x, w) + 1e-30)
    for m in (1, 33):
        np.testing.assert_array_equal(runs[f"m{m}"], full[:m])
    np.testing.assert_array_equal(runs["perm"], full[PERM])


@pytest.mark.slow
def test_invariance_check_can_fail():
    """Negative control: another K tiling changes the summation order, and the bits show it."""
    by_128, by_256 = one_program(
        lambda x, w: [CASES.matmul(x, w, out_dtype=jnp.float32, block_k=bk) for bk in (128, 256)],
        acts(8, seed=5),
        weight("bf16"),
    )
    assert not np.array_equal(by_128, by_256)


@pytest.mark.slow
def test_bf16_inputs_default_out_dtype():
    CASES.assert_bf16_in_bf16_out()


@pytest.mark.parametrize("fmt", slow_but(formats.FORMATS, "w4a16"))
def test_grouped_matches_reference_and_is_invariant(fmt):
    runs, w, x = tpu_runs(fmt), weight(fmt, shape=(3, K, N), seed=7), acts(70, seed=8)
    y = runs["grouped"]
    for e, rows in ((0, slice(0, 10)), (2, slice(10, 50))):
        ref = reference_matmul(np.asarray(x[rows]), jax.tree.map(lambda a, e=e: np.asarray(a)[e], w))
        np.testing.assert_allclose(y[rows], ref, rtol=1e-5, atol=1e-5)
    assert np.all(y[50:] == 0)
    np.testing.assert_array_equal(runs["behind"][35:75], y[10:50])


def test_errors_are_clear():
    w = weight("w8a8")
    with pytest.raises(ValueError, match="K=256"):
        CASES.matmul(acts(2, k=128), w)
    with pytest.raises(ValueError, match="Mosaic tiles"):
        CASES.matmul(acts(2), w, block_n=96)
    g32 = formats.QuantizedWeight(jnp.zeros((K // 2, N), jnp.int8), jnp.ones((K // 32, N)), "w4a16", 32)
    with pytest.raises(ValueError, match="group size"):
        CASES.matmul(acts(2), g32)
    with pytest.raises(ValueError, match="group_sizes"):
        CASES.grouped(acts(2), weight("bf16", shape=(2, K, N)), jnp.array([1]))
    with pytest.raises(ValueError, match="integer"):  # the public check: one error for shape and dtype
        kp.grouped_matmul(acts(2), weight("bf16", shape=(2, K, N)), jnp.array([1.0, 1.0]), backend="tpu")
