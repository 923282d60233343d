"""The GPU backend of every operation: Pallas on Triton, selected here and nowhere else.

JAX 0.10/0.11 pick Mosaic GPU for a ``pallas_call`` with no compiler parameters; passing Triton's
``CompilerParams`` selects Triton, which lowers these kernels on Hopper and kept rows bitwise
invariant on the H200. Triton is deprecated upstream since JAX 0.11 but present in 0.11.2. Triton
needs every loaded array to have a power-of-two number of elements: the kernels only load
power-of-two tiles.
"""

from __future__ import annotations

from jax.experimental.pallas import triton as _triton

MIN_TILE = 16  # smallest Triton dot dimension


def compiler_params(num_warps: int, num_stages: int) -> _triton.CompilerParams:
    """Pallas-Triton with these launch settings."""
    return _triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
