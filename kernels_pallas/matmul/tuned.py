"""H200-measured GPU block configs per (fmt, K, N), read by :func:`kernels_pallas.matmul.gpu.gpu_blocks`.

Measured 2026-11-30 on an H200 by ``benchmarks/gpu_tune.py`` (results in
``benchmarks/results/2026-11-30-h200-tuned/``); each entry passed accuracy and M-invariance checks.
Keys are ``(fmt, K, N)``, never M: an entry fixes the tile shapes and K order of every call on that
weight shape, so rows stay bitwise invariant to M. Changing an entry of a float-accumulating format
(bf16, w4a16, w4a8, fp8) changes that shape's output bits (the same for every M): runs compared
bitwise must use one table. For w8a8 the int32 accumulation is exact and an entry changes speed only.

An entry holds only the :class:`kernels_pallas._tiling.Blocks` fields that differ from the
format's base blocks (``gpu.base_blocks``).

``TUNED_GROUPED`` is the grouped (MoE) kernel's table: its entries go over the dense entry of the
same (fmt, K, N) (mostly ``split_k``, which is 1 without one).

A device sweep (``benchmarks/gpu_sweep.py``) writes its winners as JSON, ``{"dense": {"fmt,K,N":
{field: value}}, "grouped": {...}, "env": {...}}``; the file ``tuned_gpu.json`` beside this module,
when committed, is read at import and its entries replace the tables' (``QARL_GPU_TUNED`` names
another file: the sweep re-times the engine with its winners that way). Rollout and training
processes compared bitwise must read the same tables.
"""

from __future__ import annotations

import json
import os
import pathlib

Entry = dict[str, int | bool | str]

TUNED: dict[tuple[str, int, int], Entry] = {
    ("bf16", 2048, 6144): dict(split_k=2),
    ("bf16", 4096, 4096): dict(split_k=4),
    ("w4a16", 2048, 6144): dict(block_n=64, block_k=128, split_k=8, swap_ab=True),
    ("w4a16", 4096, 4096): dict(block_k=128, num_stages=5, split_k=4),
    ("w4a8", 2048, 6144): dict(split_k=4),
    ("w4a8", 4096, 4096): dict(block_n=64, split_k=4),
    ("w8a8", 2048, 6144): dict(split_k=4),
    ("w8a8", 4096, 4096): dict(split_k=4),
}

TUNED_GROUPED: dict[tuple[str, int, int], Entry] = {}

JSON_PATH = pathlib.Path(__file__).with_name("tuned_gpu.json")


def read_json(path: pathlib.Path) -> dict[str, dict[tuple[str, int, int], Entry]]:
    """The tables of a sweep's JSON: {"dense": {(fmt, K, N): entry}, "grouped": {...}}. Raises
    ValueError naming the file and the key that is wrong."""
    try:
        raw = json.loads(path.read_text())
        tables: dict[str, dict[tuple[str, int, int], Entry]] = {}
        for kind in ("dense", "grouped"):
            table = {}
            for key, entry in raw.get(kind, {}).items():
                fmt, k, n = key.split(",")
                if not isinstance(entry, dict):
                    raise ValueError(f"{kind} entry {key!r} is not an object")
                table[(fmt, int(k), int(n))] = entry
            tables[kind] = table
        return tables
    except (OSError, ValueError) as err:
        raise ValueError(f"GPU tuning file {path}: {err}") from None


def _load() -> None:
    named = os.environ.get("QARL_GPU_TUNED")
    path = pathlib.Path(named) if named else JSON_PATH
    if named or path.exists():
        tables = read_json(path)
        TUNED.update(tables["dense"])
        TUNED_GROUPED.update(tables["grouped"])


_load()
