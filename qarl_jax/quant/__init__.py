"""The model's one door to quantized matmuls (and the only qarl_jax module that imports AQT).

Training passes float master kernels: AQT quantizes them on the fly under a straight-through
estimator. The rollout passes frozen :class:`QuantizedWeight` leaves (``quantize_params``, AQT's
freeze). Both reach the same kernel with the same integers, so their outputs are bitwise equal;
AQT's integers and scales are exactly :func:`kernels_pallas.quantize`'s (see
:mod:`qarl_jax.quant.aqt`).

Kinds: attention, mlp, experts (quantized by default), lm_head, router, embed (run the bf16-format
invariant kernel unless listed in ``QuantSpec.quantized``). ``spec=None`` is plain XLA, the naive
path for alignment baselines and Hugging Face parity tests.

``quantize_params`` recognises kinds by path (see :func:`kind_of`). AQT is imported on the first
quantized weight, so importing the model or the rollout engine does not need it.

Modules:
  spec.py    :class:`QuantSpec`, the layer kinds (``KINDS``) and the aligned / naive modes
  matmul.py  :func:`dot`, :func:`grouped_dot`, and the column helpers of a column-blocked model
  freeze.py  :func:`quantize_params` (the rollout's frozen weights) and :func:`kind_of`
  aqt.py     the AQT quantizer whose integers and scales are ``kernels_pallas.quantize``'s
"""

from kernels_pallas import QuantizedWeight
from qarl_jax.quant.freeze import kind_of, quantize_params
from qarl_jax.quant.matmul import column_slice, dot, grouped_dot, pad_columns
from qarl_jax.quant.spec import KINDS, MODES, QuantSpec

__all__ = [
    "KINDS",
    "MODES",
    "QuantSpec",
    "QuantizedWeight",
    "dot",
    "grouped_dot",
    "kind_of",
    "column_slice",
    "pad_columns",
    "quantize_params",
]
