"""The CPU path's one loop: independent rows, processed in fixed blocks of rows.

Why this keeps rows bitwise independent of M: every block runs the same fixed-shape program, so a
row's arithmetic never depends on how many rows share the call or what its neighbours hold. Three
details make XLA:CPU keep that program whatever surrounds the call:

- the inputs pass through ``lax.optimization_barrier``, like a kernel boundary: no producer is
  fused into the loop body (it would be fused differently in different programs);
- the trip count passes through the barrier too, so a single block is still a real loop (XLA
  compiles a loop it knows runs once as straight-line code and fuses it differently);
- the inputs and outputs carry one spare block: a dynamic slice or update of a one-block array is
  the whole array, which XLA simplifies into another fusion (measured: RoPE's bits changed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax


def map_row_blocks(
    fn: Callable[..., tuple[jax.Array, ...]],
    inputs: Sequence[jax.Array],
    block_rows: int,
    outs: Sequence[jax.ShapeDtypeStruct],
) -> tuple[jax.Array, ...]:
    """``fn(*blocks) -> tuple`` over blocks of ``block_rows`` rows of every input (leading axis M,
    zero-padded to a block multiple). ``outs`` give one row's shape and dtype of each output;
    returns the outputs [M, ...] (padding rows dropped)."""
    m = inputs[0].shape[0]
    nb = max(-(-m // block_rows), 1)
    inputs = lax.optimization_barrier(tuple(inputs))

    def blocked(a):
        a = jnp.pad(a, [(0, (nb + 1) * block_rows - m)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(nb + 1, block_rows, *a.shape[1:])

    blocks = [blocked(a) for a in inputs]
    init = tuple(jnp.zeros((nb + 1, block_rows, *o.shape), o.dtype) for o in outs)

    def body(i, acc):
        ys = fn(*(lax.dynamic_index_in_dim(b, i, keepdims=False) for b in blocks))
        return tuple(
            lax.dynamic_update_index_in_dim(a, y.astype(a.dtype), i, 0) for a, y in zip(acc, ys, strict=True)
        )

    res = lax.fori_loop(0, lax.optimization_barrier(jnp.int32(nb)), body, init)
    return tuple(r.reshape((nb + 1) * block_rows, *r.shape[2:])[:m] for r in res)
