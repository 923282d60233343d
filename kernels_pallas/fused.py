"""A chain of row-wise kernels run as one row-block program: ``fused_rows``.

Why: on the CPU every row-wise kernel (matmul, RMSNorm, RoPE, ...) is its own fixed-row-block loop,
and at decode sizes a loop's fixed cost (the barrier, the padded copies, the spare block, the loop
itself) outweighs its arithmetic: a Qwen3 decoder layer was ~16 loops. The per-token part of a
layer (norm, projections, q/k norms, RoPE; or output projection, residual, norm, MLP, residual)
only ever mixes values within a token, so it can run as ONE block program over fixed blocks of
tokens. Every row still runs the same fixed-shape program whatever M, its neighbours or the
program around it (the argument of :mod:`kernels_pallas._rowblocks`, now for the whole chain), so
rollout == training bitwise as long as both run the same chain with the same ``block_rows``.

Other backends run ``fn`` on all rows: each GPU/TPU kernel is invariant by itself.

Gradients: the forward is the fused loop; the backward differentiates ``fn`` applied to all rows
at once (each kernel's block program on every row, their custom VJPs: STE for the matmuls). The
backward need not be invariant, and ``prepare`` (weight-only work such as quantizing master
weights, hoisted out of the loop) is left to ``fn``'s own kernels there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from kernels_pallas import _backend
from kernels_pallas._rowblocks import fused_block, map_row_blocks
from kernels_pallas._tiling import rows_per_block

RowFn = Callable[..., tuple[jax.Array, ...]]


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
    prepare: Callable[[Any], Any] | None = None,
    backend: str | None = None,
) -> tuple[jax.Array, ...]:
    """``fn(*row_blocks, shared) -> tuple`` over the rows (leading axis M of every ``rows`` array;
    every output has that leading axis too), each row bitwise independent of the others.
    ``shared`` (weights, a pytree) is given whole to every block; ``prepare(shared)`` runs once
    before the loop (e.g. quantizing master weights) and ``fn`` gets its result in the forward.
    ``block_rows`` must not depend on M (a function of the row widths)."""
    rows = tuple(rows)
    if not rows or len({r.shape[0] for r in rows}) != 1:
        raise ValueError(f"fused_rows needs row arrays with one leading size, got {[r.shape for r in rows]}")
    if block_rows < 1:
        raise ValueError(f"block_rows must be positive, got {block_rows}")
    prepare = prepare or _identity
    if _backend.resolve(backend) != "cpu":
        return tuple(fn(*rows, prepare(shared)))
    return _fused(fn, prepare, block_rows, rows, shared)


def _identity(tree: Any) -> Any:
    return tree


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fused(fn: RowFn, prepare, block_rows: int, rows: tuple[jax.Array, ...], shared):
    prepared = prepare(shared)
    with fused_block():
        blocks = [jax.ShapeDtypeStruct((block_rows, *r.shape[1:]), r.dtype) for r in rows]
        outs = jax.eval_shape(lambda *b: tuple(fn(*b, prepared)), *blocks)
        one_row = [jax.ShapeDtypeStruct(o.shape[1:], o.dtype) for o in outs]
        return map_row_blocks(lambda *b: tuple(fn(*b)), rows, block_rows, one_row, shared=prepared)


def _fused_fwd(fn, prepare, block_rows, rows, shared):
    return _fused(fn, prepare, block_rows, rows, shared), (rows, shared)


def _fused_bwd(fn, prepare, block_rows, res, g):
    def whole(rows, shared):
        with fused_block():
            return tuple(fn(*rows, shared))

    _, vjp = jax.vjp(whole, *res)
    return vjp(tuple(g))


_fused.defvjp(_fused_fwd, _fused_bwd)
