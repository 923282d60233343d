"""Grouped (MoE experts) quantized matmul: ``api`` (public functions and the STE), ``reference``
(float64), ``cpu`` / ``gpu`` / ``tpu`` kernels, ``common`` (the accelerators' tile work list)."""

from kernels_pallas.grouped.api import grouped_matmul, grouped_matmul_ste
from kernels_pallas.grouped.reference import expert_weight, reference_grouped_matmul

__all__ = ["expert_weight", "grouped_matmul", "grouped_matmul_ste", "reference_grouped_matmul"]
