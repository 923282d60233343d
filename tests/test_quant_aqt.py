"""AQT as the weight quantizer/freezer: its integers and scales are kernels_pallas.formats' bit for bit."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from aqt.jax.v2 import aqt_quantizer, calibration
from aqt.jax.v2 import utils as aqt_utils

import kernels_pallas as kp
from kernels_pallas.formats import int_values
from qarl_jax import quant
from qarl_jax.quant import aqt as qaqt

K, N, E = 256, 24, 3
CASES = [  # (fmt, group_size, leading expert axis)
    ("w8a8", None, ()),
    ("w8a8", None, (E,)),
    ("w4a16", 32, ()),
    ("w4a16", K, ()),
    ("w4a16", None, (E,)),
    ("w4a8", 64, ()),
    ("w4a8", None, (E,)),
    ("fp8", None, ()),
    ("fp8", None, (E,)),
]
QMAX = {"w8a8": 127, "w4a16": 7, "w4a8": 7, "fp8": 448}
# e4m3's finite values, ascending: fp8's grid (its ties are the midpoints of neighbours)
E4M3_GRID = np.unique(np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32))
E4M3_GRID = E4M3_GRID[np.isfinite(E4M3_GRID)]


def _tie_column(rng, qmax: int, group: int) -> np.ndarray:
    """A column whose values sit on ties of their group's scale (half-integers; for fp8, midpoints
    of neighbouring e4m3 values): dividing by the scale and multiplying by its reciprocal round
    many of them differently."""
    parts = []
    for _ in range(K // group):
        absmax = np.float32(rng.uniform(0.5, 2.0))
        scale = np.float32(absmax / np.float32(qmax))
        if qmax == QMAX["fp8"]:
            i = rng.integers(0, E4M3_GRID.size - 1, size=group - 1)
            halves = (E4M3_GRID[i] + E4M3_GRID[i + 1]) / np.float32(2)
        else:
            halves = rng.integers(-qmax, qmax, size=group - 1).astype(np.float32) + np.float32(0.5)
        parts.append(np.concatenate([[absmax], (halves * scale).astype(np.float32)]))
    return np.concatenate(parts)


def _weight(lead, qmax, seed, group=K, dtype=jnp.float32) -> jax.Array:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((*lead, K, N)).astype(np.float32)
    w[..., 0] = 0.0  # an all-zero column: scale 1
    w[..., 1] *= 1e4  # an outlier column
    w[..., 2] = _tie_column(rng, qmax, group)
    return jnp.asarray(w).astype(dtype)


def _bits(a) -> np.ndarray:
    """The raw bits of f32 and e4m3 arrays (equal bits, not merely equal values); ints as they are."""
    a = np.asarray(a)
    if a.dtype == np.float32:
        return a.view(np.uint32)
    return a.view(np.uint8) if a.dtype == jnp.float8_e4m3fn else a


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=("f32", "bf16"))
@pytest.mark.parametrize(("fmt", "group_size", "lead"), CASES)
def test_aqt_equals_formats_bitwise(fmt, group_size, lead, dtype):
    g = kp.resolve_group_size(fmt, K, group_size)
    w = _weight(lead, QMAX[fmt], seed=len(lead) + g, group=g, dtype=dtype)
    got = jax.jit(qaqt.quantize, static_argnums=(1, 2))(w, fmt, group_size)
    want = kp.quantize(w, fmt, group_size)
    assert (got.fmt, got.group_size) == (want.fmt, want.group_size)
    assert got.values.dtype == want.values.dtype and got.scales.dtype == want.scales.dtype
    np.testing.assert_array_equal(_bits(got.values), _bits(want.values))
    np.testing.assert_array_equal(_bits(got.scales), _bits(want.scales))


def test_qtensor_is_tiled_along_k_and_dequantizes_like_formats():
    w = _weight((E,), 7, seed=1)
    qt = qaqt.quantize_qtensor(w, "w4a16", 32)
    assert qt.qvalue.shape == (E, K // 32, 32, N) and qt.scale[0].shape == (E, K // 32, 1, N)
    assert int(jnp.abs(qt.qvalue).max()) <= 7
    np.testing.assert_array_equal(_bits(qt.dequant()), _bits(kp.dequantize(kp.quantize(w, "w4a16", 32))))


def test_stock_aqt_calibration_differs():
    """Why qarl_jax.quant.aqt has its own calibration class: all-zero columns."""
    w = _weight((), 127, seed=2)
    stock = aqt_quantizer.Quantizer(
        numerics=qaqt.weight_quantizer("w8a8").numerics,
        calib_shared_axes=None,
        scale_stop_grad=True,
        scale_dtype=jnp.float32,
        calibration=calibration.AbsMaxCalibration,
        context=aqt_utils.Context(key=None, train_step=None),
    )
    stock.init_calibration()
    qt, _ = stock.quant(w, calibration_axes=[0])
    want = kp.quantize(w, "w8a8")
    assert qt.scale[0][0, 0] == np.float32(1 / 127) and want.scales[0, 0] == 1.0
    np.testing.assert_array_equal(qt.qvalue, int_values(want))  # XLA:CPU rewrites w / s as w * (1 / s)


def test_model_door_quantizes_through_aqt(monkeypatch):
    calls, aqt_quantize = [], qaqt.quantize

    def spy(w, fmt, group_size=None):
        calls.append(fmt)
        return aqt_quantize(w, fmt, group_size)

    monkeypatch.setattr(qaqt, "quantize", spy)
    spec = quant.QuantSpec(fmt="w4a16", group_size=32)
    x = jnp.ones((2, K), jnp.float32)
    quant.dot(x, _weight((), 7, 3), spec, "mlp")
    quant.grouped_dot(x, _weight((E,), 7, 4), jnp.array([1, 0, 1], jnp.int32), spec)
    quant.quantize_params({"mlp": {"up_proj": {"kernel": _weight((), 7, 5)}}}, spec)
    quant.dot(x, _weight((), 7, 6), spec, "lm_head")  # an unquantized kind: bf16, no quantizer
    assert calls == ["w4a16"] * 3


def test_model_and_rollout_import_without_aqt():
    code = "import sys, qarl_jax.quant, qarl_jax.models, qarl_jax.rollout; print('aqt' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_aqt_quantize_errors():
    w = jnp.ones((K, N))
    with pytest.raises(ValueError, match="not 'bf16'"):
        qaqt.quantize(w, "bf16")
    with pytest.raises(ValueError, match="unknown quantization format 'w3a3'"):
        qaqt.quantize(w, "w3a3")
    with pytest.raises(ValueError, match="not a multiple of the group size 96"):
        qaqt.quantize(w, "w4a16", 96)
    with pytest.raises(TypeError, match="floating-point"):
        qaqt.quantize(jnp.ones((K, N), jnp.int32), "w8a8")
