"""TPU kernels: Pallas Mosaic (``jax.experimental.pallas.tpu``).

No TPU is available to this project's developers: these kernels are checked by lowering for the
TPU platform on CPU (``.lower(lowering_platforms=("tpu",))``) and by running them in Pallas' TPU
interpret mode against ``formats.reference_matmul``. Their speed on real TPUs is unmeasured.

Modules: ``matmul`` (dense, every format) and ``grouped_matmul`` (MoE experts).
"""

from __future__ import annotations

from jax.experimental.pallas import tpu as _pltpu

PARALLEL, ARBITRARY = "parallel", "arbitrary"


def compiler_params(*semantics: str) -> _pltpu.CompilerParams:
    """Mosaic parameters: grid axes' semantics (the K axis is 'arbitrary': it runs in order)."""
    return _pltpu.CompilerParams(dimension_semantics=semantics)


def interpret_params() -> _pltpu.InterpretParams:
    """Pallas' TPU interpreter (TPU memory spaces and grid semantics, on CPU)."""
    return _pltpu.InterpretParams()
