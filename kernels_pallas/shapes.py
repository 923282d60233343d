"""The model shapes each Pallas backend's kernels tile, refused in one line before a run (by
``qarl_jax.run.build``, before a checkpoint loads) rather than in a kernel's trace. The CPU path (and
XLA's) takes every shape the formats take.

- GPU (Pallas-Triton): attention and RoPE hold a head in one power-of-two Triton block of at least
  16 lanes (head_dim a power of two >= 16); the int4 matmul walks K in power-of-two groups of at
  least 32 rows (two 16-row tiles).
- TPU (Pallas Mosaic): the int4 matmul steps K by whole groups of a multiple of 64 rows (32 packed
  rows, a whole int8 sublane tile); heads are padded to the 128 lanes, any head_dim runs.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax

# Triton's smallest dot dimension (kernels_pallas._triton.MIN_TILE, not imported: that module loads
# Pallas' Triton front end)
_MIN_TILE = 16
_TPU_GROUP = 64


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def unsupported_shape(backend: str, head_dim: int, group_sizes: Iterable[int] = ()) -> str | None:
    """The one-line reason a model of ``head_dim`` whose int4 weights use ``group_sizes`` cannot run
    on ``backend``'s kernels ("gpu", "tpu"; the others take every shape), or None. Pure: tested
    without the hardware."""
    groups = sorted(set(group_sizes))
    if backend == "gpu":
        if head_dim < _MIN_TILE or not _pow2(head_dim):
            need = f"a power-of-two head_dim >= {_MIN_TILE}"
            return f"the GPU attention and RoPE kernels need {need}, got {head_dim}"
        bad = [g for g in groups if g < 2 * _MIN_TILE or not _pow2(g)]
        need = f"power-of-two group sizes >= {2 * _MIN_TILE}"
    elif backend == "tpu":
        bad = [g for g in groups if g % _TPU_GROUP]
        need = f"group sizes that are multiples of {_TPU_GROUP}"
    else:
        return None
    if not bad:
        return None
    return (
        f"the {backend.upper()} int4 matmul needs {need}; got {bad}: set quant.group_size to one "
        "that divides every K, or a per-channel format (w8a8, fp8)"
    )


def check_shapes(head_dim: int, group_sizes: Iterable[int] = ()) -> None:
    """Raise ValueError with :func:`unsupported_shape`'s line for JAX's default backend (the one the
    kernels run on unless told otherwise)."""
    reason = unsupported_shape(jax.default_backend(), head_dim, group_sizes)
    if reason is not None:
        raise ValueError(reason)
