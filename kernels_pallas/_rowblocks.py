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

Fusion (:func:`kernels_pallas.fused_rows`): while a chain of row-wise kernels is traced as one
block program, the row-wise kernels (``fusable``) apply their block program to the rows they are
given instead of starting loops of their own, so the chain costs one loop, not one per kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

_FUSED: contextvars.ContextVar[bool] = contextvars.ContextVar("kernels_pallas_fused_rows", default=False)


@contextlib.contextmanager
def fused_block() -> Iterator[None]:
    """While tracing within: row-wise kernels run their block program on the rows they are given."""
    token = _FUSED.set(True)
    try:
        yield
    finally:
        _FUSED.reset(token)


def in_fused_block() -> bool:
    """Whether a fused chain's block program is being traced (its rows: the chain's fixed block)."""
    return _FUSED.get()


def row_kernel(*, static_argnames: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """``jax.jit`` a row-wise CPU kernel, except inside :func:`fused_block`: there it is traced
    inline (a cached jit trace would be the looped program, not the block program)."""

    def wrap(fn: Callable) -> Callable:
        jitted = jax.jit(fn, static_argnames=static_argnames)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return fn(*args, **kwargs) if _FUSED.get() else jitted(*args, **kwargs)

        return call

    return wrap


def map_row_blocks(
    fn: Callable[..., tuple[jax.Array, ...]],
    inputs: Sequence[jax.Array],
    block_rows: int,
    outs: Sequence[jax.ShapeDtypeStruct],
    *,
    shared: Any = None,
    fusable: bool = False,
) -> tuple[jax.Array, ...]:
    """``fn(*blocks) -> tuple`` over blocks of ``block_rows`` rows of every input (leading axis M,
    zero-padded to a block multiple). ``outs`` give one row's shape and dtype of each output;
    returns the outputs [M, ...] (padding rows dropped). ``shared`` (a pytree, passed through the
    barrier with the inputs) is given to ``fn`` as its last argument when not None. A ``fusable``
    call inside :func:`fused_block` is ``fn`` on the given rows: its caller's loop is the loop."""
    extra = () if shared is None else (shared,)
    if fusable and _FUSED.get():
        ys = fn(*inputs, *extra)
        return tuple(y.astype(o.dtype) for y, o in zip(ys, outs, strict=True))
    m = inputs[0].shape[0]
    nb = max(-(-m // block_rows), 1)
    inputs, shared = lax.optimization_barrier((tuple(inputs), shared))
    extra = () if shared is None else (shared,)

    def blocked(a):
        a = jnp.pad(a, [(0, (nb + 1) * block_rows - m)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(nb + 1, block_rows, *a.shape[1:])

    blocks = [blocked(a) for a in inputs]
    init = tuple(jnp.zeros((nb + 1, block_rows, *o.shape), o.dtype) for o in outs)

    def body(i, acc):
        ys = fn(*(lax.dynamic_index_in_dim(b, i, keepdims=False) for b in blocks), *extra)
        return tuple(
            lax.dynamic_update_index_in_dim(a, y.astype(a.dtype), i, 0) for a, y in zip(acc, ys, strict=True)
        )

    res = lax.fori_loop(0, lax.optimization_barrier(jnp.int32(nb)), body, init)
    return tuple(r.reshape((nb + 1) * block_rows, *r.shape[2:])[:m] for r in res)
