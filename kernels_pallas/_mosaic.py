"""The TPU backend of every operation: Pallas Mosaic (``jax.experimental.pallas.tpu``).

No TPU is available to this project's developers: these kernels are checked by lowering for the
TPU platform on CPU (``.lower(lowering_platforms=("tpu",))``) and by running them in Pallas' TPU
interpret mode against the references. Their speed on real TPUs is unmeasured.
"""

from __future__ import annotations

from typing import Final, Literal

from jax.experimental.pallas import tpu as _pltpu

PARALLEL: Final = "parallel"
ARBITRARY: Final = "arbitrary"
SUBLANES, LANES = 8, 128  # a 32-bit VMEM tile


def compiler_params(*semantics: Literal["parallel", "arbitrary"]) -> _pltpu.CompilerParams:
    """Mosaic parameters: grid axes' semantics (a reduction axis is 'arbitrary': it runs in order)."""
    return _pltpu.CompilerParams(dimension_semantics=semantics)


def interpret_mode(flag: bool) -> _pltpu.InterpretParams | bool:
    """``pallas_call``'s ``interpret=``: Pallas' TPU interpreter (TPU memory spaces and grid
    semantics, on CPU) when asked, else compile for the TPU."""
    return _pltpu.InterpretParams() if flag else False
