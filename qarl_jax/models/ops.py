"""The row-wise operations of the forward, one place each.

Every norm, attention, softmax and log-softmax in the models goes through these functions; they run
the batch-invariant kernels of ``kernels_pallas`` (fixed row blocks, fixed key-block and vocabulary
chunk order), so a token's bits do not depend on the batch, the packing or the KV-cache length.
A layer's per-token chains (norms, projections, RoPE, residuals) run as one such program each
(:func:`fused_tokens`). Only exact or elementwise work (activations, gathers) is left to XLA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from kernels_pallas import fused_rows, rowwise
from kernels_pallas.attention import CacheLayout, Visibility
from kernels_pallas.attention import attention as invariant_attention
from kernels_pallas.attention import cached_attention as cached_invariant_attention
from qarl_jax import sharding

R = TypeVar("R")  # what the per-device function returns: an array or a tuple of them
MATMUL_OUTPUT = "matmul_output"  # checkpoint name of every projection's output (remat "save_dots")


def per_device(
    fn: Callable[..., R],
    *args,
    batched: tuple[bool, ...],
    specs: tuple[P | None, ...] | None = None,
    out_specs: P | tuple[P, ...] | None = None,
    row_axes: tuple[int, ...] | None = None,
    out_row_axes: tuple[int, ...] | None = None,
) -> R:
    """``fn(*args)`` with each device running it on its own batch rows (leading axis of the
    ``batched`` args and of the result) under the active mesh and the logical "batch" rule; other
    args are gathered whole. ``specs`` (one per arg, None: that default) splits more: for a
    non-batched arg its whole PartitionSpec (e.g. the experts over the expert axis), for a batched
    one the dims after the rows (e.g. heads over the tensor axis); ``out_specs`` likewise the dims
    after the rows of each output (a tuple of outputs). Why: under plain jit the SPMD partitioner
    splits a kernel's row-block loop its own way (measured: FSDP layouts changed the bits); inside
    ``shard_map`` every device runs the single-device program. Rows are replicated when the batch
    does not divide. ``row_axes`` (one per arg) and ``out_row_axes`` (one per output of a tuple):
    the axis of the rows, if not the first (a stacked KV cache's slots); ``specs`` and
    ``out_specs`` then name the dims after it."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or mesh.manual_axes:  # no mesh, or already per device
        return fn(*args)
    if any(a is None for a in args):  # absent optional inputs stay out of shard_map
        present = [i for i, a in enumerate(args) if a is not None]

        def with_nones(*xs):
            full = [None] * len(args)
            for i, x in zip(present, xs, strict=True):
                full[i] = x
            return fn(*full)

        kept = None if specs is None else tuple(specs[i] for i in present)
        return per_device(
            with_nones,
            *(args[i] for i in present),
            batched=tuple(batched[i] for i in present),
            specs=kept,
            out_specs=out_specs,
            row_axes=None if row_axes is None else tuple(row_axes[i] for i in present),
            out_row_axes=out_row_axes,
        )
    names = sharding.batch_axes()
    axes = row_axes or (0,) * len(args)
    rows = next(a.shape[r] for a, b, r in zip(args, batched, axes, strict=True) if b)
    lead = names if names and rows % sharding.axis_ways(names, mesh) == 0 else None
    given = specs or (None,) * len(args)
    in_specs = tuple(
        P(*(None,) * r, lead, *(s or ())) if b else (s or P())
        for b, s, r in zip(batched, given, axes, strict=True)
    )
    out: P | tuple[P, ...]
    if out_specs is None:
        out = P(lead)
    elif isinstance(out_specs, P):  # one output
        out = P(lead, *out_specs)
    else:
        outs = out_row_axes or (0,) * len(out_specs)
        out = tuple(P(*(None,) * r, lead, *o) for o, r in zip(out_specs, outs, strict=True))
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out, check_vma=False)(*args)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The rollout engine's tensor-parallel axis: every projection's columns (in the model's
    ``tensor_blocks``) and the attention heads split over ``axis`` of ``size`` devices; what a
    device computes is gathered (exact concatenation, no float sum) where a whole row is needed."""

    axis: str
    size: int

    def gather(self, x: jax.Array) -> jax.Array:
        """The whole last axis of ``x`` (inside ``per_device``: this device's columns, in order)."""
        return lax.all_gather(x, self.axis, axis=x.ndim - 1, tiled=True)


def tensor_parallel() -> TensorParallel | None:
    """The active tensor-parallel axis: the mesh axis the logical rules map "tensor_parallel" to,
    when it spans more than one device. Only the rollout engine's rules name it: the training
    forward keeps whole weights per device (``per_device`` gathers them) and computes the same
    column blocks one after another."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:
        return None
    spec = nn.logical_to_mesh_axes(("tensor_parallel",))
    axes = sharding.mesh_axis_names(spec[0] if spec is not None else None)
    if len(axes) != 1 or mesh.shape[axes[0]] == 1:
        return None
    return TensorParallel(axes[0], mesh.shape[axes[0]])


def fused_tokens(
    fn: Callable[..., tuple[jax.Array, ...]],
    rows: tuple[jax.Array, ...],
    weights,
    *,
    block_rows: int,
    prepare: Callable | None = None,
    name: str = "fused_tokens",
    row_specs: tuple[P | None, ...] | None = None,
    weight_specs=None,
    out_specs: tuple[P, ...] | None = None,
) -> tuple[jax.Array, ...]:
    """``fn(*token_blocks, weights)`` over the tokens of ``rows`` [B, T, ...] as one row-block
    program (:func:`kernels_pallas.fused_rows`), per device; outputs [B, T, ...]. For the per-token
    chains of a layer (norms, projections, RoPE, residuals): one loop instead of one per kernel,
    every token's bits still independent of the batch. ``name`` scopes its ops (profiles, HLO).
    ``row_specs`` / ``weight_specs`` / ``out_specs``: the splits beyond the rows (see
    :func:`per_device`; tensor parallel: heads and columns over the tensor axis)."""

    def run(*args):
        *xs, w = args
        b, t = xs[0].shape[:2]
        flat = [a.reshape(b * t, *a.shape[2:]) for a in xs]
        outs = fused_rows(fn, flat, w, block_rows=block_rows, prepare=prepare)
        return tuple(o.reshape(b, t, *o.shape[1:]) for o in outs)

    specs = (*(row_specs or (None,) * len(rows)), weight_specs)
    with jax.named_scope(name):
        return per_device(
            run, *rows, weights, batched=(*(True,) * len(rows), False), specs=specs, out_specs=out_specs
        )


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3's RMSNorm: normalise in f32, cast back to the input dtype, then scale."""
    return per_device(lambda x, w: rowwise.rms_norm(x, w, eps), x, weight, batched=(True, False))


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, visibility: Visibility, tp: TensorParallel | None = None
) -> jax.Array:
    """Causal grouped-query attention. q [B,T,H,D], k/v [B,S,KV,D]; query (b, t) sees the keys at
    indices starts[b, t] + 0..positions[b, t] (starts None: 0, the KV cache) of its own segment
    (segment ids [B, T] / [B, S]: a packed row, S == T, passes its segment_ids as both). ``tp``:
    the heads split over its axis (each device its q heads and their kv heads)."""
    batched = (True,) * (3 + len(visibility))
    if tp is None:
        return per_device(invariant_attention, q, k, v, *visibility, batched=batched)
    heads = P(None, tp.axis, None)
    specs = (heads, heads, heads, *(None,) * len(visibility))
    return per_device(
        invariant_attention, q, k, v, *visibility, batched=batched, specs=specs, out_specs=heads
    )


def cached_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: tuple[jax.Array, jax.Array],
    layer: jax.Array | int,
    positions: jax.Array,
    layout: CacheLayout,
    tp: TensorParallel | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """This step's k, v [B,T,KV,D] written at ``positions`` [B,T] into layer ``layer`` of the
    stacked ``cache`` (k, v) of ``layout``, then q [B,T,H,D]'s attention against that layer
    (:func:`kernels_pallas.attention.cached_attention`: on a TPU the kernel reads the layer where
    it lies), per device: the cache's slots (axis 1) split like the rows, its heads like q's with
    ``tp``. Returns (the attention [B,T,H,D], the updated cache). Both steps run per device: the
    write's view of the cache as rows (see ``CacheLayout.write``) would merge the slots' split."""

    def fn(q, k, v, ck, cv, i, p):
        ck, cv = layout.write(ck, i, p, k), layout.write(cv, i, p, v)
        return cached_invariant_attention(q, ck, cv, i, p, layout), ck, cv

    layer = jnp.asarray(layer, jnp.int32)
    heads = P() if tp is None else P(None, tp.axis, None)
    axes = layout.axes(None, None if tp is None else tp.axis)
    stack = P(*axes[2:])  # the dims after the slots
    out, ck, cv = per_device(
        fn,
        q,
        k,
        v,
        *cache,
        layer,
        positions,
        batched=(True, True, True, True, True, False, True),
        specs=(heads, heads, heads, stack, stack, None, None),
        out_specs=(heads, stack, stack),
        row_axes=(0, 0, 0, 1, 1, 0, 0),
        out_row_axes=(0, 1, 1),
    )
    return out, (ck, cv)


def softmax(logits: jax.Array) -> jax.Array:
    """Probabilities over the last axis in f32."""
    return per_device(rowwise.softmax, logits, batched=(True,))


def log_softmax(logits: jax.Array, temperature: float | jax.Array = 1.0) -> jax.Array:
    """Log-probabilities of ``logits / temperature`` over the vocabulary in f32; ``temperature`` is
    a float or an array of the row shape (one per row: the rollout's per-slot settings)."""
    return _per_row(rowwise.log_softmax, logits, temperature)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float | jax.Array = 1.0) -> jax.Array:
    """log p(target) per position: logits [..., V], targets [...] -> [...] (f32); bitwise equal to
    ``log_softmax(logits, temperature)`` at the target, whatever the number of rows, and equal
    between a float temperature (trainer) and a per-row array (rollout)."""
    return _per_row(
        lambda x, t, y: rowwise.token_logprobs(x, y, t), logits, temperature, targets, batched=(True,)
    )


def _per_row(fn: Callable[..., jax.Array], logits, temperature, *rows, batched: tuple[bool, ...] = ()):
    """``fn(logits, temperature, *rows)`` per device. A float temperature stays a Python number
    (the kernels skip the scaling at 1 and fold the reciprocal otherwise); an array is broadcast to
    the row shape and split with the rows."""
    if isinstance(temperature, jax.Array):
        temps = jnp.broadcast_to(temperature, logits.shape[:-1])
        return per_device(fn, logits, temps, *rows, batched=(True, True, *batched))
    return per_device(lambda x, *r: fn(x, temperature, *r), logits, *rows, batched=(True, *batched))
