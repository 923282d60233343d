"""GPU kernels: Pallas on the Triton backend.

The backend is chosen here and nowhere else. JAX 0.10/0.11 pick Mosaic GPU for a ``pallas_call``
with no compiler parameters; passing Triton's ``CompilerParams`` selects Triton, which lowers our
kernels on Hopper and kept rows bitwise invariant on the H200 (../shared/notes/measurements.md).
Triton is deprecated upstream since JAX 0.11 but present in 0.11.2. Triton needs every loaded
array to have a power-of-two number of elements: the kernels only load power-of-two tiles.

Modules: ``matmul`` (dense, every format) and ``grouped_matmul`` (MoE experts).
"""

from __future__ import annotations

from jax.experimental.pallas import triton as _triton


def compiler_params(num_warps: int, num_stages: int) -> _triton.CompilerParams:
    """The one place the GPU backend is selected: Pallas-Triton with these launch settings."""
    return _triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
