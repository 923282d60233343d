"""The TPU backend of every operation: Pallas Mosaic (``jax.experimental.pallas.tpu``).

No TPU is available to this project's developers. These kernels are compiled by the real TPU
compiler (XLA:TPU and Mosaic from ``libtpu``) on a CPU host for TPU topologies with no chip attached
(``qarl_jax.tools.tpu_compile``; ``tests/test_tpu_compile.py``), and run in Pallas' TPU interpret
mode against the references. Their speed, and the bits a chip computes, are unmeasured.
"""

from __future__ import annotations

import math
from typing import Any, Final, Literal

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as _pl
from jax.experimental.pallas import tpu as _pltpu

PARALLEL: Final = "parallel"
ARBITRARY: Final = "arbitrary"
SUBLANES, LANES = 8, 128  # a 32-bit VMEM tile


def compiler_params(
    *semantics: Literal["parallel", "arbitrary"], vmem_bytes: int | None = None, fuse_inputs: int = 0
) -> _pltpu.CompilerParams:
    """Mosaic parameters: grid axes' semantics (a reduction axis is 'arbitrary': it runs in order)
    and, for a kernel whose blocks outgrow Mosaic's default scoped VMEM, the VMEM it needs.
    ``fuse_inputs``: XLA may fuse the producers of that many operands into the kernel's reads (a
    layer's slice of a stacked weight: without it XLA:TPU copies the slice out first)."""
    fusion = [True] * fuse_inputs if fuse_inputs else None
    return _pltpu.CompilerParams(
        dimension_semantics=semantics, vmem_limit_bytes=vmem_bytes, allow_input_fusion=fusion
    )


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
    flops: int,
    grid: tuple[int, ...],
    specs: list[_pl.BlockSpec],
    operands: list[jax.Array | jax.ShapeDtypeStruct],
    *,
    transcendentals: int = 0,
    prefetch: tuple[jax.Array, ...] = (),
) -> _pl.CostEstimate:
    """What a kernel costs, for XLA's scheduler (a ``pallas_call`` is opaque to it, and without an
    estimate it cannot tell how long a kernel runs, so it cannot hide a collective, an FSDP
    all-gather or the expert all-to-all, behind it) and for ``qarl_jax.tools.program_cost``'s
    floors: ``flops``, and as bytes what the block ``specs`` move between HBM and VMEM over
    ``grid`` (:func:`block_bytes`; ``operands``: the inputs then the outputs, in the specs' order;
    ``prefetch``: the scalar-prefetched operands the index maps also get)."""
    moved = block_bytes(grid, specs, operands, prefetch)
    return _pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=moved)


def block_bytes(
    grid: tuple[int, ...],
    specs: list[_pl.BlockSpec],
    operands: list[jax.Array | jax.ShapeDtypeStruct],
    prefetch: tuple[jax.Array, ...] = (),
) -> int:
    """Bytes Pallas' pipeline copies for ``specs`` over ``grid``: it steps the grid in row-major
    order (last axis fastest) and copies a block in (an input) or out (an output) whenever the
    block's index differs from the previous step's. A block whose index depends on grid axes ``A``
    (read off its index map's jaxpr) changes at every step of the axes up to the last of ``A``
    with more than one step, and at no other: that many copies of the block. Exact where the index
    map is one-to-one in those axes; where it reads prefetched data (the grouped matmul's tile
    lists, whose consecutive tiles may share an expert) an upper bound."""
    total = 0
    for spec, x in zip(specs, operands, strict=True):
        axes = _grid_axes(spec.index_map, len(grid), prefetch)
        moving = [a for a in axes if grid[a] > 1]
        copies = math.prod(grid[: max(moving) + 1]) if moving else 1
        block: tuple[Any, ...] = tuple(spec.block_shape if spec.block_shape is not None else x.shape)
        elements = math.prod([1 if d is None else int(d) for d in block])
        total += copies * elements * jnp.dtype(x.dtype).itemsize
    return total


def _grid_axes(index_map, rank: int, prefetch: tuple[jax.Array, ...]) -> set[int]:
    """The grid axes an index map's result depends on (through any op, prefetched lists included)."""
    args = [jax.ShapeDtypeStruct((), jnp.int32)] * rank + [
        jax.ShapeDtypeStruct(p.shape, p.dtype) for p in prefetch
    ]
    jaxpr = jax.make_jaxpr(index_map)(*args).jaxpr
    depends = {v: {i} for i, v in enumerate(jaxpr.invars[:rank])}
    for eqn in jaxpr.eqns:
        found = set().union(
            *(depends.get(v, set()) for v in eqn.invars if not isinstance(v, jex.core.Literal))
        )
        for v in eqn.outvars:
            depends[v] = found
    return set().union(*(depends.get(v, set()) for v in jaxpr.outvars if not isinstance(v, jex.core.Literal)))
