"""A chain of row-wise kernels run as one row-block program: ``fused_rows``.

Why: on the CPU every row-wise kernel (matmul, RMSNorm, RoPE, ...) is its own fixed-row-block loop,
and at decode sizes a loop's fixed cost (the barrier, the padded copies, the spare block, the loop
itself) outweighs its arithmetic: a Qwen3 decoder layer was ~16 loops. The per-token part of a
layer (norm, projections, q/k norms, RoPE; or output projection, residual, norm, MLP, residual)
only ever mixes values within a token, so it can run as ONE block program over fixed blocks of
tokens. Every row still runs the same fixed-shape program whatever M, its neighbours or the
program around it (the argument of :mod:`kernels_pallas._rowblocks`, now for the whole chain), so
rollout == training bitwise as long as both run the same chain with the same ``block_rows``.
One kernel stays a loop of its own, nested in the chain's block: RoPE (f32 cos / sin and products
took other bits in a one-column-block chain than in a chain of several; see its CPU kernel).

Other backends run ``fn`` on all rows at once: each GPU/TPU kernel is invariant by itself. They
share the custom VJP below, which keeps ``prepare`` out of the differentiated program.

Gradients: the forward is the fused loop; the backward differentiates ``fn`` (each kernel's block
program, their custom VJPs: STE for the matmuls) over chunks of ``backward_rows`` rows, one chunk at
a time in a scan that sums the weights' cotangents in f32. Why chunks: differentiating ``fn`` on all
M rows at once keeps every intermediate of the chain (norms, q/k/v, the dense MLP's gate and up)
alive for all M rows; a 16k-token row of the Qwen3-8B shape held 88 GB in one layer's backward. With
chunks the backward holds one chunk's intermediates, as the forward holds one block's. The backward
need not be invariant, and ``prepare`` (weight-only work such as quantizing master weights, hoisted
out of the loop) is left to ``fn``'s own kernels there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas import _backend
from kernels_pallas._rowblocks import fused_block, map_row_blocks
from kernels_pallas._tiling import rows_per_block

RowFn = Callable[..., tuple[jax.Array, ...]]

# Rows per backward chunk, in forward blocks: a chunk's widest intermediate holds ~64 x 32K = 2M
# elements (8 MB in f32), large enough that the weight-gradient matmuls stay efficient.
BACKWARD_BLOCKS = 64


def default_block_rows(widest: int) -> int:
    """Rows per block of a fused chain: a power of two in [8, 64] keeping a block of the chain's
    widest row near 32K elements (half a single kernel's: a chain holds several live blocks). A
    function of the widths only, never of M."""
    return rows_per_block(widest, budget=1 << 15)


def fused_rows(
    fn: RowFn,
    rows: Sequence[jax.Array],
    shared: Any = None,
    *,
    block_rows: int,
    backward_rows: int | None = None,
    prepare: Callable[[Any], Any] | None = None,
    backend: str | None = None,
) -> tuple[jax.Array, ...]:
    """``fn(*row_blocks, shared) -> tuple`` over the rows (leading axis M of every ``rows`` array;
    every output has that leading axis too), each row bitwise independent of the others.
    ``shared`` (weights, a pytree) is given whole to every block; ``prepare(shared)`` runs once
    before the loop (e.g. quantizing master weights) and ``fn`` gets its result in the forward.
    ``block_rows`` must not depend on M (a function of the row widths); the backward runs over
    chunks of ``backward_rows`` rows (default ``BACKWARD_BLOCKS * block_rows``)."""
    rows = tuple(rows)
    if not rows or len({r.shape[0] for r in rows}) != 1:
        raise ValueError(f"fused_rows needs row arrays with one leading size, got {[r.shape for r in rows]}")
    if block_rows < 1:
        raise ValueError(f"block_rows must be positive, got {block_rows}")
    backward_rows = BACKWARD_BLOCKS * block_rows if backward_rows is None else backward_rows
    if backward_rows < 1:
        raise ValueError(f"backward_rows must be positive, got {backward_rows}")
    prepare = prepare or _identity
    # GPU/TPU kernels are invariant by themselves: one call on all rows (block_rows None), but the
    # same custom VJP, so ``prepare`` stays forward-only there too (differentiating through it would
    # reach the frozen-weight kernels' ``pallas_call``, which has no JVP) and the backward is chunked
    per_block = block_rows if _backend.resolve(backend) == "cpu" else None
    return _fused(fn, prepare, per_block, backward_rows, rows, shared)


def _identity(tree: Any) -> Any:
    return tree


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _fused(
    fn: RowFn, prepare, block_rows: int | None, backward_rows: int, rows: tuple[jax.Array, ...], shared
):
    prepared = prepare(shared)
    if block_rows is None:
        return tuple(fn(*rows, prepared))
    with fused_block():
        blocks = [jax.ShapeDtypeStruct((block_rows, *r.shape[1:]), r.dtype) for r in rows]
        outs = jax.eval_shape(lambda *b: tuple(fn(*b, prepared)), *blocks)
        one_row = [jax.ShapeDtypeStruct(o.shape[1:], o.dtype) for o in outs]
        return map_row_blocks(lambda *b: tuple(fn(*b)), rows, block_rows, one_row, shared=prepared)


def _fused_fwd(fn, prepare, block_rows, backward_rows, rows, shared):
    return _fused(fn, prepare, block_rows, backward_rows, rows, shared), (rows, shared)


def _differentiable(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _float0_zeros(x) -> np.ndarray:
    return np.zeros(x.shape, jax.dtypes.float0)


def _fused_bwd(fn, prepare, block_rows, backward_rows, res, g):
    """The VJP of ``fn`` chunk by chunk: (row cotangents [M, ...], the shared tree's cotangent).
    Integer rows and leaves (positions, frozen int weights) get float0 zeros."""
    rows, shared = res
    g = tuple(g)
    leaves, treedef = jax.tree.flatten(shared)
    float_leaves = [i for i, x in enumerate(leaves) if _differentiable(x)]
    float_rows = [i for i, r in enumerate(rows) if _differentiable(r)]

    def chunk_vjp(chunk_rows, chunk_g):
        """(cotangents of the chunk's float rows, of the float shared leaves)."""

        def chain(row_args, leaf_args):
            full_rows, full_leaves = list(chunk_rows), list(leaves)
            for i, x in zip(float_rows, row_args, strict=True):
                full_rows[i] = x
            for i, x in zip(float_leaves, leaf_args, strict=True):
                full_leaves[i] = x
            with fused_block():
                return tuple(fn(*full_rows, jax.tree.unflatten(treedef, full_leaves)))

        _, vjp = jax.vjp(chain, [chunk_rows[i] for i in float_rows], [leaves[i] for i in float_leaves])
        return vjp(chunk_g)

    m = rows[0].shape[0]
    chunks, tail = divmod(m, backward_rows)
    if chunks <= 1:  # fewer than two whole chunks: one pass over them (< 2 x backward_rows rows)
        d_rows, d_leaves = chunk_vjp(rows, g)
    else:
        split = chunks * backward_rows
        stack = lambda a: a[:split].reshape(chunks, backward_rows, *a.shape[1:])

        def body(acc, xs):
            chunk_rows, chunk_g = xs
            d_rows, d_leaves = chunk_vjp(chunk_rows, chunk_g)
            return [a + d.astype(a.dtype) for a, d in zip(acc, d_leaves, strict=True)], d_rows

        acc = [
            jnp.zeros(leaves[i].shape, jnp.promote_types(leaves[i].dtype, jnp.float32)) for i in float_leaves
        ]
        acc, d_rows = lax.scan(body, acc, (tuple(stack(r) for r in rows), tuple(stack(x) for x in g)))
        d_rows = [d.reshape(split, *d.shape[2:]) for d in d_rows]
        if tail:
            t_rows, t_leaves = chunk_vjp(tuple(r[split:] for r in rows), tuple(x[split:] for x in g))
            d_rows = [jnp.concatenate([d, t]) for d, t in zip(d_rows, t_rows, strict=True)]
            acc = [a + d.astype(a.dtype) for a, d in zip(acc, t_leaves, strict=True)]
        d_leaves = [a.astype(leaves[i].dtype) for a, i in zip(acc, float_leaves, strict=True)]

    row_cts: list[Any] = [_float0_zeros(r) for r in rows]
    for i, d in zip(float_rows, d_rows, strict=True):
        row_cts[i] = d
    leaf_cts: list[Any] = [_float0_zeros(x) for x in leaves]
    for i, d in zip(float_leaves, d_leaves, strict=True):
        leaf_cts[i] = d
    return tuple(row_cts), jax.tree.unflatten(treedef, leaf_cts)


_fused.defvjp(_fused_fwd, _fused_bwd)
