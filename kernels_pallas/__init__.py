"""Batch-invariant kernels (quantized matmuls in bf16 / w8a8 / w4a16 / w4a8 / fp8, MoE grouped matmul,
attention, row-wise ops) whose every row is bitwise independent of the batch: rollout == training.

Layout, one package per operation, each with the same modules::

    <op>/api.py        public functions, custom VJPs (STE for the matmuls); ``backend=``,
                       ``interpret=`` and block-size overrides (``**tiling``) as keyword arguments
    <op>/reference.py  the plain / float64 reference
    <op>/cpu.py        plain JAX over fixed row blocks
    <op>/gpu.py        Pallas-Triton
    <op>/tpu.py        Pallas Mosaic
    <op>/xla.py        XLA's own ops: fast, NOT batch-invariant (to measure what invariance costs)
    <op>/common.py     what the op's paths share

    matmul/      dense quantized matmul (+ ``tuned.py``, the GPU's measured block table)
    grouped/     grouped (ragged, MoE experts) quantized matmul
    attention/   causal grouped-query attention over packed rows or a KV cache
    rowwise/     RMSNorm, RoPE, the tempered log-sum-exp, log-softmax, token log-probs

    formats.py     the int8 / int4 / e4m3 data contract every backend reads
    _backend.py    resolve the backend and load its module lazily (the one place);
                   ``default_backend(name)`` sets it for calls traced within a block
    _checks.py     operand checks, one per operand kind
    _tiling.py     block sizes, powers of two, padding
    _rowblocks.py  the CPU path's one row-block loop
    fused.py       ``fused_rows``: a chain of row-wise kernels as one row-block program
    _triton.py / _mosaic.py  the GPU / TPU Pallas compiler settings
    gpu_support.py the formats a GPU's compute capability runs (fp8 from 8.9), refused in one line
    shapes.py      the head sizes and int4 groups the GPU / TPU kernels tile, refused in one line

Imports nothing but JAX (and numpy, which JAX requires); a backend's Pallas module is imported on
its first call.
"""

from kernels_pallas._backend import default_backend
from kernels_pallas.formats import (
    FORMATS,
    QuantizedWeight,
    dequantize,
    quantize,
    quantize_activations,
    resolve_group_size,
)
from kernels_pallas.fused import fused_rows
from kernels_pallas.grouped import grouped_matmul, grouped_matmul_ste, reference_grouped_matmul
from kernels_pallas.matmul import quantized_matmul, quantized_matmul_ste, reference_matmul

__all__ = [
    "FORMATS",
    "QuantizedWeight",
    "default_backend",
    "dequantize",
    "fused_rows",
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
