"""Dense quantized matmul (bf16, w8a8, w4a16, w4a8, fp8): ``api`` (public functions and the STE),
``reference`` (float64), ``cpu`` / ``gpu`` (Pallas-Triton) / ``tpu`` (Pallas Mosaic) kernels,
``common`` (what the two Pallas kernels share), ``tuned`` (the GPU's measured block table)."""

from kernels_pallas.matmul.api import quantized_matmul, quantized_matmul_ste
from kernels_pallas.matmul.reference import reference_matmul

__all__ = ["quantized_matmul", "quantized_matmul_ste", "reference_matmul"]
