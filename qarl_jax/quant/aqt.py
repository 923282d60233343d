"""AQT (aqtp 0.9, ``aqt.jax.v2``) as the model's weight quantizer and freezer.

AQT calibrates and quantizes every quantized weight: on the fly from the master weights in the
training forward (AQT's TRAIN mode) and once for the rollout (its CONVERT/SERVE freeze: int values
+ scales). Its :class:`QTensor` is then handed to our kernels as a :class:`QuantizedWeight`; our
kernel is the raw matmul and quantizes activations itself (per token, row-invariant).

The integers and scales are exactly :func:`kernels_pallas.formats.quantize`'s, so training and
rollout, AQT or not, run the same kernel on the same bits:
- numerics: AQT's ``IntSymmetric`` with ``preserve_zero`` and ``preserve_max_val`` has quant bound
  qmax (127 / 7), clips to [-qmax, qmax] and rounds half to even: our numerics as they are; for
  fp8 its ``Fp8Numerics`` (e4m3) has quant bound 448, clips to [-448, 448] and casts to e4m3
  (nearest, ties to even), as :func:`kernels_pallas.formats.quantize` does;
- groups: AQT's tiling of the contraction axis K into tiles of ``group_size`` rows, calibrated
  per tile: scales [.., K // group_size, N] (per channel is one tile of K rows);
- two small classes of ours where stock AQT is not our numerics: its ``AbsMaxCalibration`` gives
  all-zero groups scale 1 / qmax (ours: 1); its ``QTensor.quant`` multiplies by
  ``reciprocal(scale)`` where we divide. XLA happens to rewrite ``w / broadcast(s)`` into
  ``w * broadcast(1 / s)`` on CPU, so those agree there, but only through that rewrite; our
  quantizer divides like :func:`kernels_pallas.formats.quantize`, the same op on every backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from aqt.jax.v2 import aqt_quantizer, aqt_tensor, calibration
from aqt.jax.v2 import utils as aqt_utils
from aqt.jax.v2.numerics import fp8_numerics, int_numerics, numerics
from aqt.jax.v2.tiled_dot_general import AxisTiling, generate_tiling_state

from kernels_pallas.formats import VALUE_DTYPE, WEIGHT_BITS, QuantizedWeight, pack_int4, resolve_group_size


@aqt_utils.flax_slots_kw_only_dataclass
class FormatsAbsMaxCalibration(calibration.Calibration):
    """Abs-max calibration with scale = absmax / quant_bound, and 1 for all-zero groups (as ours)."""

    def get_scale_and_bias_and_sparsity(self, x, shared_axes, numerics_, context=None):
        del context
        absmax = jnp.max(jnp.abs(x), axis=shared_axes, keepdims=True)
        scale = jnp.where(absmax > 0, absmax / numerics_.get_quant_bound(), 1.0)
        return [scale.astype(self.dtype or x.dtype)], [], None


@aqt_utils.flax_slots_kw_only_dataclass
class DividingQuantizer(aqt_quantizer.Quantizer):
    """AQT's quantizer, dividing by the scale as :mod:`kernels_pallas.formats` does (stock AQT
    multiplies by its reciprocal: equal only where XLA rewrites the division the same way)."""

    def calculate_qvalue(self, x, qt: aqt_tensor.QTensor):
        if qt.tiling_state is not None:
            x = qt.tiling_state.apply(x)
        (scale,) = qt.scale
        qvalue, res = self.numerics.vjp_fwd(x / scale, self.context)
        return qt.replace(qvalue=qvalue), jax.tree_util.Partial(self.numerics.vjp_bwd, res)


def _numerics(fmt: str) -> numerics.AqtNumerics:
    """fp8: e4m3 values; the integer formats: ``bits``-bit integers in an int8 container (int4
    values are packed by us, two per byte). No stochastic rounding."""
    if VALUE_DTYPE[fmt] == jnp.float8_e4m3fn:
        return fp8_numerics.Fp8Numerics(dtype=jnp.float8_e4m3fn, stochastic_rounding=False)
    return int_numerics.IntSymmetric(
        bits=WEIGHT_BITS[fmt],
        preserve_zero=True,
        preserve_max_val=True,
        clip=True,
        clip_gradient=False,
        round=True,
        noise_fn=None,
        dtype=jnp.int8,
    )


@functools.cache
def weight_quantizer(fmt: str) -> DividingQuantizer:
    """The AQT quantizer of ``fmt``'s weights (a quantized format): f32 scales."""
    quantizer = DividingQuantizer(
        numerics=_numerics(fmt),
        calib_shared_axes=None,
        scale_stop_grad=True,
        scale_dtype=jnp.float32,
        calibration=FormatsAbsMaxCalibration,
        context=aqt_utils.Context(key=None, train_step=None),
    )
    quantizer.init_calibration()
    return quantizer


def quantize_qtensor(w: jax.Array, fmt: str, group_size: int) -> aqt_tensor.QTensor:
    """AQT-quantize a [.., K, N] weight into ``fmt`` calibrated per tile of ``group_size`` rows of
    K: qvalue [.., K // group_size, group_size, N] int8 (e4m3 for fp8), scale
    [.., K // group_size, 1, N] f32."""
    w = w.astype(jnp.float32)
    k_axis = w.ndim - 2
    tiling = generate_tiling_state(w, [AxisTiling(axis=k_axis, tile_size=group_size)])
    qt, _ = weight_quantizer(fmt).quant(w, calibration_axes=[k_axis], tiling_state=tiling)
    return qt


def to_quantized_weight(qt: aqt_tensor.QTensor, fmt: str, group_size: int) -> QuantizedWeight:
    """Our kernels' layout of an AQT weight QTensor (tiles merged back, int4 packed)."""
    (scale,) = qt.scale
    q = qt.qvalue.reshape(qt.tiling_state.untiled_shape)
    values = pack_int4(q, group_size) if WEIGHT_BITS[fmt] == 4 else q
    return QuantizedWeight(values=values, scales=jnp.squeeze(scale, -2), fmt=fmt, group_size=group_size)


def quantize(w: jax.Array, fmt: str, group_size: int | None = None) -> QuantizedWeight:
    """:func:`kernels_pallas.quantize` through AQT, bit for bit, for the quantized formats."""
    g = resolve_group_size(fmt, w.shape[-2], group_size)
    if WEIGHT_BITS[fmt] is None:
        raise ValueError(f"AQT quantizes weights of the quantized formats, not {fmt!r}")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"quantize expects floating-point weights, got {w.dtype}")
    return to_quantized_weight(quantize_qtensor(w, fmt, g), fmt, g)


__all__ = [
    "DividingQuantizer",
    "FormatsAbsMaxCalibration",
    "quantize",
    "quantize_qtensor",
    "to_quantized_weight",
    "weight_quantizer",
]
