"""Batch-invariant quantized matmuls (bf16, w8a8, w4a16, w4a8) for bitwise rollout == training.

See :mod:`kernels_pallas.formats` for the data contract shared by every backend.
"""

from kernels_pallas.formats import (
    FORMATS,
    QuantizedWeight,
    dequantize,
    quantize,
    quantize_activations,
    reference_matmul,
    resolve_group_size,
)
from kernels_pallas.grouped import grouped_matmul, reference_grouped_matmul
from kernels_pallas.matmul import quantized_matmul
from kernels_pallas.ste import grouped_matmul_ste, quantized_matmul_ste

__all__ = [
    "FORMATS",
    "QuantizedWeight",
    "dequantize",
    "grouped_matmul",
    "grouped_matmul_ste",
    "quantize",
    "quantize_activations",
    "quantized_matmul",
    "quantized_matmul_ste",
    "reference_grouped_matmul",
    "reference_matmul",
    "resolve_group_size",
]
