"""H200-measured GPU block configs per (fmt, K, N), read by :func:`kernels_pallas.matmul.gpu.gpu_blocks`.

Measured 2026-11-30 on an H200 by ``benchmarks/gpu_tune.py`` (results in
``benchmarks/results/2026-11-30-h200-tuned/``); each entry passed accuracy and M-invariance checks.
Keys are ``(fmt, K, N)``, never M: an entry fixes the tile shapes and K order of every call on that
weight shape, so rows stay bitwise invariant to M. Changing an entry of a float-accumulating format
(bf16, w4a16, w4a8, fp8) changes that shape's output bits (the same for every M): runs compared
bitwise must use one table. For w8a8 the int32 accumulation is exact and an entry changes speed only.

An entry holds only the :class:`kernels_pallas._tiling.Blocks` fields that differ from the
format's base blocks (``gpu.base_blocks``).
"""

from __future__ import annotations

TUNED: dict[tuple[str, int, int], dict[str, int | bool | str]] = {
    ("bf16", 2048, 6144): dict(split_k=2),
    ("bf16", 4096, 4096): dict(split_k=4),
    ("w4a16", 2048, 6144): dict(block_n=64, block_k=128, split_k=8, swap_ab=True),
    ("w4a16", 4096, 4096): dict(block_k=128, num_stages=5, split_k=4),
    ("w4a8", 2048, 6144): dict(split_k=4),
    ("w4a8", 4096, 4096): dict(block_n=64, split_k=4),
    ("w8a8", 2048, 6144): dict(split_k=4),
    ("w8a8", 4096, 4096): dict(split_k=4),
}
