"""The TPU backend of every operation: Pallas Mosaic (``jax.experimental.pallas.tpu``).

No TPU is available to this project's developers. These kernels are compiled by the real TPU
compiler (XLA:TPU and Mosaic from ``libtpu``) on a CPU host for TPU topologies with no chip attached
(``qarl_jax.tools.tpu_compile``; ``tests/test_tpu_compile.py``), and run in Pallas' TPU interpret
mode against the references. Their speed, and the bits a chip computes, are unmeasured.
"""

from __future__ import annotations

import math
from typing import Final, Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as _pl
from jax.experimental.pallas import tpu as _pltpu

PARALLEL: Final = "parallel"
ARBITRARY: Final = "arbitrary"
SUBLANES, LANES = 8, 128  # a 32-bit VMEM tile


def compiler_params(
    *semantics: Literal["parallel", "arbitrary"], vmem_bytes: int | None = None
) -> _pltpu.CompilerParams:
    """Mosaic parameters: grid axes' semantics (a reduction axis is 'arbitrary': it runs in order)
    and, for a kernel whose blocks outgrow Mosaic's default scoped VMEM, the VMEM it needs."""
    return _pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_bytes)


def interpret_mode(flag: bool) -> _pltpu.InterpretParams | bool:
    """``pallas_call``'s ``interpret=``: Pallas' TPU interpreter (TPU memory spaces and grid
    semantics, on CPU) when asked, else compile for the TPU."""
    return _pltpu.InterpretParams() if flag else False


def mxu_dot(a: jax.Array, b: jax.Array, acc, dims=(((1,), (0,)), ((), ()))) -> jax.Array:
    """``dot_general(a, b)`` on the MXU, accumulated in ``acc``, exact in every product.

    bf16 x bf16 and int8 x int8 products are exact in f32 / int32 at the MXU's default precision,
    so those dots ask for none: Mosaic rejects ``contract_precision<fp32>`` on them ("Bad lhs
    type"). f32 operands ask for HIGHEST, which Mosaic lowers to full-f32 passes (the default
    would round them to bf16). Either way the K order within a tile is the MXU's, fixed by the
    tile shape, which no kernel derives from M: rows stay invariant."""
    precision = lax.Precision.HIGHEST if jnp.dtype(a.dtype) == jnp.float32 else None
    return lax.dot_general(a, b, dims, preferred_element_type=acc, precision=precision)


def cost(
    flops: int, *operands: jax.Array | jax.ShapeDtypeStruct, transcendentals: int = 0
) -> _pl.CostEstimate:
    """What a kernel costs, for XLA's scheduler: a ``pallas_call`` is opaque to it, and without an
    estimate it cannot tell how long a kernel runs, so it cannot hide a collective (an FSDP
    all-gather, the expert all-to-all) behind it. ``operands``: every array the kernel reads or
    writes, each read once (the bytes moved between HBM and VMEM at the least)."""
    moved = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in operands)
    return _pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=moved)
