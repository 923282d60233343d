"""AQT (aqtp 0.9) front door for per-channel formats, with our row-block kernel as its raw dot.

AQT quantizes (TRAIN: master weights on the fly), calibrates and freezes (CONVERT writes int
weights + scales into the ``aqt`` collection; SERVE reads them). Its raw ``dot_general`` is
injectable (``cfg.fwd.dot_general``); we inject :func:`invariant_dot_general`, which runs the
Dense-shaped forward over fixed row blocks, so every row is batch-invariant and TRAIN and SERVE
multiply the same integers with the same program. AQT's own numerics (scale = absmax / 127.5,
not / 127) differ from :mod:`kernels_pallas.formats`, so AQT outputs are not bitwise our
``qarl_jax.quant.dot``'s; AQT's group-wise path (tiled_dot_general) is too slow, so group-wise
formats use ``qarl_jax.quant.dot`` only. AQT is end-of-life upstream; Qwix is the successor.
"""

from __future__ import annotations

import jax.numpy as jnp
from aqt.jax.v2 import config as aqt_cfg
from aqt.jax.v2 import utils as aqt_utils
from aqt.jax.v2.flax import aqt_flax
from jax import lax

from kernels_pallas import cpu_matmul
from kernels_pallas.formats import ACT_BITS, WEIGHT_BITS, check_format

QuantMode = aqt_utils.QuantMode
AQT_FORMATS = ("w8a8", "w4a16", "w4a8")


def invariant_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
    """AQT's raw dot: Dense-shaped contractions (last lhs axis with first rhs axis, no batch axes)
    run over fixed row blocks; other shapes (AQT's gradient dots) fall back to ``lax.dot_general``."""
    (lc, rc), (lb, rb) = dimension_numbers
    if tuple(lc) != (lhs.ndim - 1,) or tuple(rc) != (0,) or lb or rb or rhs.ndim != 2:
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    if jnp.issubdtype(lhs.dtype, jnp.integer) and jnp.issubdtype(rhs.dtype, jnp.integer):
        lhs, rhs = lhs.astype(jnp.int8), rhs.astype(jnp.int8)  # XLA:CPU cannot dot int4 directly
        acc = jnp.int32
    else:
        ct = jnp.result_type(lhs.dtype if jnp.issubdtype(lhs.dtype, jnp.floating) else rhs.dtype, jnp.float32)
        lhs, rhs, acc = lhs.astype(ct), rhs.astype(ct), jnp.float32
    out_dtype = preferred_element_type or acc
    *lead, k = lhs.shape
    x2d = lhs.reshape(-1, k)
    block_rows = cpu_matmul.default_block_rows(k, rhs.shape[1])

    def block_fn(_, xb):
        return lax.dot_general(xb, rhs, (((1,), (0,)), ((), ())), lax.Precision.HIGHEST, acc)

    y = cpu_matmul.row_block_map(
        block_fn, cpu_matmul.pad_rows(x2d, block_rows), block_rows, rhs.shape[1], out_dtype
    )
    return y[: x2d.shape[0]].reshape(*lead, rhs.shape[1])


def aqt_config(fmt: str):
    """AQT config for ``fmt`` (per output channel, no stochastic rounding, unquantized backward)."""
    check_format(fmt)
    if fmt not in AQT_FORMATS:
        raise ValueError(f"AQT path supports {AQT_FORMATS}, got {fmt!r}; bf16 needs no quantizer")
    w_bits, a_bits = WEIGHT_BITS[fmt], ACT_BITS[fmt]
    cfg = aqt_cfg.fully_quantized(
        fwd_bits=w_bits, bwd_bits=None, use_fwd_quant=a_bits is not None, use_stochastic_rounding=False
    )
    aqt_cfg.set_bits(cfg, a_bits, w_bits, None, None, None, None)
    cfg.fwd.dot_general = invariant_dot_general
    return cfg


def aqt_dot_general(fmt: str, mode: QuantMode) -> aqt_flax.AqtDotGeneral:
    """A flax ``dot_general`` for ``nn.Dense``: weights frozen (int values + scales) in CONVERT
    mode and read back in SERVE mode; activations always quantized on the fly."""
    return aqt_flax.AqtDotGeneral(
        aqt_config(fmt),
        prng_name=None,  # no stochastic rounding: no key needed
        lhs_quant_mode=QuantMode.TRAIN,
        rhs_quant_mode=mode,
        use_legacy_freezer=False,
        lhs_freeze_mode=aqt_flax.FreezerMode.NONE,
        rhs_freeze_mode=aqt_flax.FreezerMode.CALIBRATION_AND_VALUE,
    )


__all__ = ["AQT_FORMATS", "QuantMode", "aqt_config", "aqt_dot_general", "invariant_dot_general"]
