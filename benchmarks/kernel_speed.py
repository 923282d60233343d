"""Quantized matmul kernels vs XLA's bf16 dot, side by side in one run, one table.

    python benchmarks/kernel_speed.py            # the accelerator's kernels at decode and training shapes
    python benchmarks/kernel_speed.py --small    # tiny shapes; on CPU only proves the script works
    python benchmarks/kernel_speed.py --shapes 4096x4096 --ms 1,16 --formats bf16,w8a8,w4a16 --budget-s 20

Per (K, N, M): median time per matmul, achieved TB/s over the weight bytes, TFLOP/s, and the
speed-up over XLA's bf16 ``jnp.dot`` on the same shape. Every timed call runs a run of matmuls
over enough weight copies (at least 4) that an H200's 60 MB L2 cannot hold them. Kernel: the public
``kernels_pallas.quantized_matmul`` on the default backend (GPU: Pallas-Triton, TPU: Pallas
Mosaic, CPU: the plain-JAX row-block path).
JSON goes to ``--json`` (default $OUT/kernels.json, OUT defaults to ./out), rewritten after every row.
(Not named ``kernels.py``: a script's folder is first on ``sys.path``, and ``transformers`` imports
the PyPI package ``kernels`` when it finds one, so ``rollout.py --hf`` beside it failed to import.)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas import formats, quantized_matmul  # noqa: E402

CACHE_BYTES = 60 * 2**20


def kernel_for_backend():
    """The public matmul on this machine's backend, and the kernel's name."""
    backend = jax.default_backend()
    name = {"gpu": "pallas-triton", "tpu": "pallas-mosaic"}.get(backend, "cpu")
    return name, lambda x, w: quantized_matmul(x, w, backend=backend)


def make_weight(key, k: int, n: int, fmt: str) -> formats.QuantizedWeight:
    w = jax.random.normal(key, (k, n), jnp.float32) * (k**-0.5)
    return formats.quantize(w.astype(jnp.bfloat16) if fmt == "bf16" else w, fmt)


def nbytes(w: formats.QuantizedWeight) -> int:
    return w.values.nbytes + (0 if w.scales is None else w.scales.nbytes)


def time_per_call(one, x, copies, calls: int, iters: int) -> float:
    """Seconds per matmul: ``iters`` executions of ``calls`` matmuls dispatched back to back (launch
    latency not counted), median of 3 such runs."""
    fn = jax.jit(lambda x, cs: [one(x, cs[c % len(cs)]) for c in range(calls)])
    jax.block_until_ready(fn(x, copies))
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            last = fn(x, copies)
        jax.block_until_ready(last)
        ts.append((time.perf_counter() - t0) / iters)
    return float(np.median(ts)) / calls


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _shapes(text: str) -> list[tuple[int, int]]:
    return [(int(k), int(n)) for k, n in (s.split("x") for s in text.split(","))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU proof run)")
    ap.add_argument("--shapes", type=_shapes, help="comma-separated KxN (default: 4096x4096,8192x8192)")
    ap.add_argument("--ms", type=_ints, help="comma-separated batch rows M (default: 1,16,64,256,4096)")
    ap.add_argument("--formats", default=",".join(formats.FORMATS), help="our kernels' formats to time")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting rows after this")
    ap.add_argument("--json", help="result file (default: $OUT/kernels.json)")
    args = ap.parse_args()
    deadline = time.perf_counter() + (args.budget_s if args.budget_s is not None else float("inf"))
    small = args.small or jax.default_backend() == "cpu"
    name, kernel = kernel_for_backend()
    if small:
        kns, ms = args.shapes or [(256, 256)], args.ms or (1, 16, 64)
        calls, iters, min_copies = 4, 3, 4
    else:
        kns, ms = args.shapes or [(4096, 4096), (8192, 8192)], args.ms or (1, 16, 64, 256, 4096)
        calls, iters, min_copies = 16, 20, 4
    shapes = [(k, n, m) for k, n in kns for m in ms]
    cols = ("xla_bf16",) + tuple(args.formats.split(","))
    unknown = [f for f in cols[1:] if f not in formats.FORMATS]
    if unknown:
        ap.error(f"unknown formats {unknown}; expected some of {formats.FORMATS}")
    out = pathlib.Path(args.json or pathlib.Path(os.environ.get("OUT", "./out")) / "kernels.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {"jax": jax.__version__, "backend": jax.default_backend(), "kernel": name, "rows": {}}
    weights: dict = {}
    for k, n, m in shapes:
        if time.perf_counter() > deadline:
            results.setdefault("skipped_over_budget", []).append(f"K={k} N={n} M={m}")
            continue
        if (k, n) not in weights:
            weights = {(k, n): {}}  # free the previous shape's copies
            for i, fmt in enumerate(cols):
                f = "bf16" if fmt == "xla_bf16" else fmt
                size = nbytes(make_weight(jax.random.key(i), k, n, f))
                count = (
                    int(min(32, max(min_copies, -(-3 * CACHE_BYTES // size)))) if not small else min_copies
                )
                keys = jax.random.split(jax.random.key(100 + i), count)
                weights[(k, n)][fmt] = ([make_weight(kk, k, n, f) for kk in keys], size)
        x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
        row = {}
        for fmt, (copies, size) in weights[(k, n)].items():
            if fmt == "xla_bf16":
                one = lambda x, w: jnp.dot(x, w.values, preferred_element_type=jnp.float32).astype(x.dtype)
            else:
                one = kernel
            t = time_per_call(one, x, copies, max(calls, len(copies)), iters)
            row[fmt] = {"us": t * 1e6, "TBps": size / t / 1e12, "TFLOPs": 2 * m * k * n / t / 1e12}
        for r in row.values():
            r["x_xla"] = row["xla_bf16"]["us"] / r["us"]
        results["rows"][f"K={k} N={n} M={m}"] = row
        print(f"K={k} N={n} M={m}: " + ", ".join(f"{f} {r['us']:.1f}us" for f, r in row.items()), flush=True)
        out.write_text(json.dumps(results, indent=1))
    out.write_text(json.dumps(results, indent=1))
    print(f"\n{name} kernels vs XLA bf16 dot on {jax.devices()[0].device_kind} (jax {jax.__version__})")
    print("cell: us per matmul | weight TB/s | TFLOP/s | speed-up over XLA bf16")
    print(f"{'shape':<22}" + "".join(f"{c:>32}" for c in cols))
    for shape, row in results["rows"].items():
        cells = (
            f"{r['us']:.1f} | {r['TBps']:.2f} | {r['TFLOPs']:.1f} | x{r['x_xla']:.2f}" for r in row.values()
        )
        print(f"{shape:<22}" + "".join(f"{c:>32}" for c in cells))


if __name__ == "__main__":
    main()
