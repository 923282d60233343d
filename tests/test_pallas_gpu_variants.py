"""The GPU kernels' decode variants (issue 54), in Pallas' interpreter and lowered for CUDA: the
magic-number int4 dequantization (the shift path's values, so the same bits), split-K with bigger
N tiles and deeper pipelines, and the grouped (MoE) kernel's split-K. Each keeps the contract: within
the float64 bound, w8a8 bit-exact, a row's bits the same at M = 1, 3 and 16. A test's interpreted
calls run as one program (see pallas_cases), each its own kernel launch at its own M."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import MatmulCases, f32_bound, one_program
from tiers import slow_but

from kernels_pallas import formats
from kernels_pallas._dequant import int4_halves
from kernels_pallas.matmul.reference import reference_matmul

K, N = 128, 64
CASES = MatmulCases("gpu", K, N, group=32, blocks=dict(block_n=32, block_k=64))
weight, acts = CASES.weight, CASES.acts


def exact_w8a8(x, w) -> np.ndarray:
    """The w8a8 kernel's promised bits: int64 accumulation, then (acc * s_x) * s_w in f32."""
    xq, sx = (np.asarray(a) for a in formats.quantize_activations(x))
    acc = xq.astype(np.int64) @ np.asarray(w.values, np.int64)
    return (acc.astype(np.float32) * sx) * np.asarray(w.scales)


def contract_calls(x, w, **knobs) -> dict[str, jax.Array]:
    """The calls :func:`assert_contract` checks (to trace into one program): 16 rows, and the
    first 1 and 3 alone."""
    return {f"m{m}": CASES.matmul(x[:m], w, out_dtype=jnp.float32, **knobs) for m in (16, 1, 3)}


def assert_contract(fmt, x, w, ys) -> None:
    """The 16-row call within the float64 bound (w8a8: exact), and rows 0..m-1 of the M = 1 and
    M = 3 calls bitwise its rows (``ys``: :func:`contract_calls`' outputs)."""
    y16 = ys["m16"]
    if fmt == "w8a8":
        np.testing.assert_array_equal(y16, exact_w8a8(x, w))
    else:
        ref = reference_matmul(np.asarray(x), w)
        assert np.all(np.abs(y16 - ref) <= f32_bound(x, w) + 1e-30)
    for m in (1, 3):
        np.testing.assert_array_equal(ys[f"m{m}"], y16[:m])


@pytest.mark.parametrize("cdt", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_magic_dequant_gives_the_shift_values(cdt):
    """Every byte value: the magic-number nibbles equal the shifted and converted ones."""
    p = jnp.arange(-128, 128, dtype=jnp.int8).reshape(16, 16)
    for got, want in zip(int4_halves(p, cdt, "magic"), int4_halves(p, cdt, "shift"), strict=True):
        assert got.dtype == want.dtype == cdt
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    high = np.asarray(int4_halves(p, cdt, "magic")[1], np.float32)
    np.testing.assert_array_equal(high[0], -8.0)  # bytes 0x80-0x8F


@pytest.mark.parametrize("dtype", slow_but([jnp.float32, jnp.bfloat16], jnp.bfloat16))
def test_magic_dequant_kernel_is_bitwise_the_shift_kernel(dtype):
    w, x = weight("w4a16"), acts(16, seed=3, dtype=dtype)
    knobs = dict(split_k=2, block_n=64, num_stages=5)
    magic, shift = one_program(
        lambda x, w: (
            contract_calls(x, w, dequant="magic", **knobs),
            CASES.matmul(x, w, out_dtype=jnp.float32, dequant="shift", **knobs),
        ),
        x,
        w,
    )
    np.testing.assert_array_equal(magic["m16"], shift)
    assert_contract("w4a16", x.astype(jnp.float32), w, magic)


# split-K (count from the knobs, i.e. from (fmt, K, N), never from M) with wider tiles and pipelines
SPLIT_VARIANTS = {
    "split4-n64-stages6": dict(split_k=4, block_k=32, block_n=64, num_stages=6),
    "split2-swap-magic": dict(split_k=2, swap_ab=True, num_warps=8, dequant="magic"),
}


@functools.cache
def split_runs(fmt: str) -> dict[str, dict[str, np.ndarray]]:
    """Both split variants' contract calls for ``fmt``, in one program."""
    calls = lambda x, w: {v: contract_calls(x, w, **knobs) for v, knobs in SPLIT_VARIANTS.items()}
    return one_program(calls, acts(16, seed=4), weight(fmt))


@pytest.mark.parametrize("fmt", slow_but(["bf16", "w8a8", "w4a16", "fp8"], "w4a16"))
@pytest.mark.parametrize("variant", SPLIT_VARIANTS)
def test_split_k_variants_keep_the_contract(fmt, variant):
    assert_contract(fmt, acts(16, seed=4), weight(fmt), split_runs(fmt)[variant])


@pytest.mark.parametrize("fmt", slow_but(["w8a8", "w4a16"], "w4a16"))
def test_grouped_split_k_keeps_the_contract(fmt):
    w = weight(fmt, shape=(3, K, N), seed=7)
    sizes = [5, 0, 9]
    x = acts(16, seed=8)  # 2 rows past the groups
    other = jnp.concatenate([acts(7, seed=9), x[5:14]])
    split = lambda x, sizes, w: CASES.grouped(x, w, sizes, out_dtype=jnp.float32, split_k=2, dequant="magic")

    def calls(x, other, w):
        return {
            "y": split(x, sizes, w),
            "unsplit": CASES.grouped(x, w, sizes, out_dtype=jnp.float32),
            # expert 2's rows alone (M = 1, 3), and behind other rows of another expert
            **{f"m{m}": split(x[5 : 5 + m], [0, 0, m], w) for m in (1, 3)},
            "other": split(other, [7, 0, 9], w),
        }

    ys = one_program(calls, x, other, w)
    y = ys["y"]
    if fmt == "w8a8":  # int32 partials: the split cannot change a bit
        np.testing.assert_array_equal(y, ys["unsplit"])
    else:
        ref = CASES.grouped_reference(x, w, sizes)
        np.testing.assert_allclose(y, ref, rtol=K * 2.0**-23 * 4, atol=K * 2.0**-23 * 4)
        assert not np.array_equal(y, ys["unsplit"])  # the split did change the f32 order
    assert np.all(y[14:] == 0)
    for m in (1, 3):
        np.testing.assert_array_equal(ys[f"m{m}"], y[5 : 5 + m])
    np.testing.assert_array_equal(ys["other"][7:], y[5:14])


def test_grouped_split_k_reads_its_table(monkeypatch):
    """The grouped table's entry sets the split (here an impossible one: plan() lowers it to what K
    allows, the result stays the split-2 kernel's bits)."""
    from kernels_pallas.grouped import gpu as gg
    from kernels_pallas.matmul import tuned

    w = weight("w4a16", shape=(2, K, N))
    assert gg.configure_grouped(w, block_k=64).split_k == 1
    monkeypatch.setitem(tuned.TUNED_GROUPED, ("w4a16", K, N), dict(split_k=2))
    assert gg.configure_grouped(w, block_k=64).split_k == 2
    assert gg.configure_grouped(w, block_k=64, split_k=1).split_k == 1


def test_unknown_dequant_is_refused():
    with pytest.raises(ValueError, match="dequant must be one of"):
        CASES.matmul(acts(2), weight("w4a16"), dequant="lut")


@pytest.mark.parametrize("fmt", ["w8a8", "w4a16", "fp8"])
def test_variants_lower_for_cuda(fmt):
    """Pallas' Triton lowering (what can be checked without CUDA: see benchmarks/gpu_sweep.py)."""
    x, w = acts(16, dtype=jnp.bfloat16), weight(fmt, dtype=jnp.bfloat16)
    knobs = dict(split_k=2, block_n=64, num_stages=5, dequant="magic")
    assert CASES.lowers(lambda x, w: CASES.matmul(x, w, interpret=False, **knobs), x, w)
    w3 = weight(fmt, shape=(3, K, N), dtype=jnp.bfloat16)
    sizes = jnp.array([5, 0, 11], jnp.int32)
    grouped = lambda x, w, s: CASES.grouped(x, w, s, interpret=False, **knobs)
    assert CASES.lowers(grouped, x, w3, sizes)


def _tuned_in_subprocess(path: str) -> subprocess.CompletedProcess:
    code = (
        "from kernels_pallas.matmul import tuned; "
        "print(tuned.TUNED[('w4a16', 4096, 4096)], tuned.TUNED_GROUPED[('w8a8', 2048, 768)])"
    )
    env = {**os.environ, "QARL_GPU_TUNED": path}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_sweep_json_becomes_the_tables(tmp_path):
    """What benchmarks/gpu_sweep.py writes is what the kernels read; a broken file names itself."""
    good = tmp_path / "tuned_gpu.json"
    entry = {"dequant": "magic", "split_k": 8, "swap_ab": True}
    good.write_text(
        json.dumps({"dense": {"w4a16,4096,4096": entry}, "grouped": {"w8a8,2048,768": {"split_k": 2}}})
    )
    proc = _tuned_in_subprocess(str(good))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == f"{entry} {{'split_k': 2}}"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"dense": {"w4a16,4096": {}}}))
    proc = _tuned_in_subprocess(str(bad))
    assert proc.returncode != 0 and f"GPU tuning file {bad}" in proc.stderr
