"""One-shot GPU evidence for the Pallas-Triton kernels: accuracy, row-wise batch invariance, speed.

Run on the H200 (well under 3 minutes):   PYTHONUNBUFFERED=1 python benchmarks/gpu_kernels_check.py
Run here first (CPU, interpret mode):     python benchmarks/gpu_kernels_check.py --small

For every format (bf16, w8a8, w4a16, w4a8, fp8) and the grouped MoE kernel:
  1. accuracy against ``reference_matmul`` (float64/int64); w8a8 also bit-exact against
     the int64 accumulator scaled in f32 as the kernel promises, y = (acc * s_x) * s_w;
  2. row-wise invariance: rows of M = 1/16/64/256 calls and of shuffled batches must be bitwise the
     rows of the M = 256 call (grouped: an expert's rows under different neighbouring groups);
  3. speed against XLA's bf16 ``jnp.dot`` at decode shapes, with enough weight copies rotated that
     the H200's L2 cannot hold them.
Each part's JSON lands in $OUT (default ./out) as soon as it exists; the table prints last.
Imports only jax, numpy and kernels_pallas (formats + the GPU kernels): no aqt/tensorflow needed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time
import traceback
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels_pallas import formats, grouped_matmul, quantized_matmul, reference_matmul  # noqa: E402

FMTS = formats.FORMATS
OUT = pathlib.Path(os.environ.get("OUT", "./out"))
RESULTS: dict = {}


def dump(name: str, obj) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(obj, indent=1, default=str))


def make_weight(key, shape, fmt: str, group: int | None) -> formats.QuantizedWeight:
    w = jax.random.normal(key, shape, jnp.float32) * (shape[-2] ** -0.5)
    group = group if formats.WEIGHT_BITS[fmt] == 4 else None
    return formats.quantize(w.astype(jnp.bfloat16) if fmt == "bf16" else w, fmt, group)


def dense_fn(interpret: bool, out_dtype=jnp.float32):
    return lambda x, w: quantized_matmul(x, w, out_dtype=out_dtype, backend="gpu", interpret=interpret)


def accuracy(cfg) -> dict:
    """Max error normalised by the f32-accumulation bound K * 2^-23 * (|x| @ |W|) (<= 1 passes)."""
    k, n, m = cfg["acc_shape"]
    out = {}
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    xf = np.asarray(x.astype(jnp.float32), np.float64)
    for i, fmt in enumerate(cfg["formats"]):
        w = make_weight(jax.random.key(10 + i), (k, n), fmt, cfg["group"])
        y = np.asarray(
            quantized_matmul(x, w, out_dtype=jnp.float32, backend="gpu", interpret=cfg["interpret"]),
            np.float64,
        )
        ref = reference_matmul(xf, w)
        xa = np.abs(xf)
        if formats.ACT_BITS[fmt] == 8:  # the activations the kernel multiplies: per-token quantized
            xq, sx = formats.quantize_activations(x, fmt)
            xa = np.abs(np.asarray(xq, np.float64) * np.asarray(sx, np.float64))
        bound = k * 2.0**-23 * (xa @ np.abs(np.asarray(formats.dequantize(w), np.float64))) + 1e-30
        r = {
            "max_abs_err": float(np.abs(y - ref).max()),
            "max_err_over_bound": float((np.abs(y - ref) / bound).max()),
        }
        if fmt == "w8a8":
            xq, sx = (np.asarray(a) for a in formats.quantize_activations(x))
            acc = xq.astype(np.int64) @ np.asarray(w.values, np.int64)
            want = (acc.astype(np.float32) * sx.astype(np.float32)) * np.asarray(w.scales, np.float32)
            r["bit_exact_vs_int64_acc"] = bool(np.array_equal(y.astype(np.float32), want))
        r["ok"] = bool(r["max_err_over_bound"] <= 1.0 and r.get("bit_exact_vs_int64_acc", True))
        out[fmt] = r
        print(f"accuracy {fmt}: {r}", flush=True)
    # grouped: E experts, uneven groups, one empty
    e, gk, gn = cfg["moe_shape"]
    sizes = np.array(cfg["moe_sizes"], np.int32)
    gm = int(sizes.sum()) + 3  # 3 rows past the groups must come out zero
    xg = jax.random.normal(jax.random.key(2), (gm, gk), jnp.bfloat16)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for i, fmt in enumerate(cfg["formats"]):
        w = make_weight(jax.random.key(30 + i), (e, gk, gn), fmt, cfg["group"])
        y = np.asarray(
            grouped_matmul(
                xg, w, jnp.asarray(sizes), out_dtype=jnp.float32, backend="gpu", interpret=cfg["interpret"]
            ),
            np.float64,
        )
        err = 0.0
        for j in range(e):
            wj = jax.tree.map(lambda a, j=j: a[j], w)
            rows = slice(starts[j], starts[j + 1])
            ref = reference_matmul(np.asarray(xg[rows].astype(jnp.float32)), wj)
            scale = np.abs(ref).max() if ref.size else 1.0
            err = max(err, float(np.abs(y[rows] - ref).max() / scale) if ref.size else 0.0)
        r = {"max_rel_err": err, "tail_rows_zero": bool(np.all(y[starts[-1] :] == 0))}
        r["ok"] = bool(err < gk * 2.0**-20 and r["tail_rows_zero"])
        out[f"grouped_{fmt}"] = r
        print(f"accuracy grouped {fmt}: {r}", flush=True)
    return out


def invariance(cfg) -> dict:
    """Rows bitwise equal to the M=256 call's rows, whatever M and whoever the neighbours are."""
    k, n = cfg["inv_shape"]
    big = max(cfg["ms"])
    x = jax.random.normal(jax.random.key(3), (big, k), jnp.bfloat16)
    perm = np.random.default_rng(0).permutation(big)
    other = jax.random.normal(jax.random.key(4), (big, k), jnp.bfloat16).at[0].set(x[0])
    out = {}
    for i, fmt in enumerate(cfg["formats"]):
        w = make_weight(jax.random.key(50 + i), (k, n), fmt, cfg["group"])
        f = jax.jit(dense_fn(cfg["interpret"]))
        full = np.asarray(f(x, w))
        r = {f"M={m}": bool(np.array_equal(np.asarray(f(x[:m], w)), full[:m])) for m in cfg["ms"]}
        r["shuffled"] = bool(np.array_equal(np.asarray(f(x[perm], w)), full[perm]))
        r["row0_other_neighbours"] = bool(np.array_equal(np.asarray(f(other, w))[0], full[0]))
        r["ok"] = all(r.values())
        out[fmt] = r
        print(f"invariance {fmt}: {r}", flush=True)
    # grouped: expert 1's rows, with expert 0 holding 3 rows or 40 rows in front of them
    e, gk, gn = cfg["moe_shape"]
    rows1 = jax.random.normal(jax.random.key(5), (24, gk), jnp.bfloat16)
    for i, fmt in enumerate(cfg["formats"]):
        w = make_weight(jax.random.key(70 + i), (e, gk, gn), fmt, cfg["group"])
        res = []
        for lead, seed in ((3, 6), (40, 7), (0, 8)):
            front = jax.random.normal(jax.random.key(seed), (lead, gk), jnp.bfloat16)
            tail = jax.random.normal(jax.random.key(seed + 100), (5, gk), jnp.bfloat16)
            xs = jnp.concatenate([front, rows1, tail])
            sizes = jnp.asarray([lead, 24, 5] + [0] * (e - 3), jnp.int32)
            y = grouped_matmul(xs, w, sizes, out_dtype=jnp.float32, backend="gpu", interpret=cfg["interpret"])
            res.append(np.asarray(y)[lead : lead + 24])
        r = {"expert_rows_invariant": bool(all(np.array_equal(res[0], q) for q in res[1:]))}
        r["ok"] = r["expert_rows_invariant"]
        out[f"grouped_{fmt}"] = r
        print(f"invariance grouped {fmt}: {r}", flush=True)
    return out


def timed(fn, args, iters: int) -> tuple[float, Any]:
    """(seconds per execution, the first call's output): ``iters`` executions dispatched back to
    back (the host runs ahead, so per-call launch latency is not counted), median of 3 such runs.
    ``gpu_tune`` times its candidates with it too."""
    out = jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            last = fn(*args)
        jax.block_until_ready(last)
        ts.append((time.perf_counter() - t0) / iters)
    return float(np.median(ts)), out


def speed(cfg, deadline: float) -> dict:
    """Median time per matmul; each timed call runs `calls` matmuls over rotating weight copies."""
    out = {}
    for k, n in cfg["speed_shapes"]:
        ws = {}
        for i, fmt in enumerate(("xla_bf16",) + tuple(cfg["formats"])):
            f = "bf16" if fmt == "xla_bf16" else fmt
            base = make_weight(jax.random.key(90 + i), (k, n), f, cfg["group"])
            nbytes = base.values.nbytes + (0 if base.scales is None else base.scales.nbytes)
            copies = int(min(32, max(4, -(-cfg["l2_bytes"] * 3 // nbytes))))
            keys = jax.random.split(jax.random.key(200 + i), copies)
            ws[fmt] = ([make_weight(kk, (k, n), f, cfg["group"]) for kk in keys], nbytes)
        for m in cfg["ms"]:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            row = {}
            for fmt, (copies, nbytes) in ws.items():
                if time.perf_counter() > deadline:
                    row[fmt] = "skipped (time budget)"
                    continue
                if fmt == "xla_bf16":
                    one = lambda x, w: jnp.dot(x, w.values, preferred_element_type=jnp.float32).astype(
                        x.dtype
                    )
                else:
                    one = dense_fn(cfg["interpret"], out_dtype=jnp.bfloat16)
                calls = max(len(copies), cfg["min_calls"])
                fn = jax.jit(
                    lambda x, cs, one=one, calls=calls: [one(x, cs[c % len(cs)]) for c in range(calls)]
                )
                t = timed(fn, (x, copies), cfg["iters"])[0] / calls
                row[fmt] = {
                    "us": t * 1e6,
                    "weight_TBps": nbytes / t / 1e12,
                    "TFLOPs": 2 * m * k * n / t / 1e12,
                }
            base = row.get("xla_bf16")
            for r in row.values():
                if isinstance(r, dict) and isinstance(base, dict):
                    r["speedup_vs_xla_bf16"] = base["us"] / r["us"]
            out[f"K={k},N={n},M={m}"] = row
            print(
                f"speed K={k} N={n} M={m}: "
                + ", ".join(
                    f"{f}={r['us']:.1f}us" if isinstance(r, dict) else f"{f}={r}" for f, r in row.items()
                ),
                flush=True,
            )
            dump("speed", out)
    return out


def table(res: dict) -> str:
    lines = ["== correctness (ok = accuracy within bound; invariance = all row checks bitwise)"]
    lines.append(f"{'kernel':<16}{'accuracy':>10}{'invariance':>12}  detail")
    acc, inv = res.get("accuracy", {}), res.get("invariance", {})
    for name in list(FMTS) + [f"grouped_{f}" for f in FMTS]:
        a, i = acc.get(name, {}), inv.get(name, {})
        det = a.get("max_err_over_bound", a.get("max_rel_err", "-"))
        lines.append(
            f"{name:<16}{str(a.get('ok', 'n/a')):>10}{str(i.get('ok', 'n/a')):>12}  err={det}"
            + (f" exact={a['bit_exact_vs_int64_acc']}" if "bit_exact_vs_int64_acc" in a else "")
        )
    sp = res.get("speed", {})
    if sp:
        lines.append("== speed: us per matmul (x XLA bf16 speed-up) [weight TB/s]")
        cols = ("xla_bf16",) + FMTS
        lines.append(f"{'shape':<24}" + "".join(f"{c:>24}" for c in cols))
        for shape, row in sp.items():
            cells = []
            for c in cols:
                r = row.get(c)
                if isinstance(r, dict):
                    cells.append(
                        f"{r['us']:.1f} (x{r.get('speedup_vs_xla_bf16', 1):.2f}) [{r['weight_TBps']:.2f}]"
                    )
                else:
                    cells.append(str(r)[:22])
            lines.append(f"{shape:<24}" + "".join(f"{c:>24}" for c in cells))
    return "\n".join(lines)


def config(small: bool, on_gpu: bool) -> dict:
    """Shapes and repeat counts of every part: the H200's, or tiny ones for a CPU proof run."""
    if small:
        cfg = dict(
            acc_shape=(128, 64, 20),
            moe_shape=(4, 64, 32),
            moe_sizes=[7, 0, 20, 5],
            inv_shape=(64, 32),
            ms=(1, 16, 64),
            group=32,
            speed_shapes=[(128, 64)],
            l2_bytes=0,
            min_calls=2,
            iters=2,
        )
    else:
        cfg = dict(
            acc_shape=(4096, 4096, 64),
            moe_shape=(8, 2048, 768),
            moe_sizes=[40, 0, 17, 100, 1, 64, 9, 25],
            inv_shape=(4096, 4096),
            ms=(1, 16, 64, 256),
            group=128,
            speed_shapes=[(4096, 4096), (2048, 6144)],
            l2_bytes=60 * 2**20,
            min_calls=16,
            iters=20,
        )
    return cfg | {"formats": FMTS, "interpret": not on_gpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes, Pallas interpret mode (CPU proof run)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting speed rows after this")
    args = ap.parse_args()
    t_start = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    small = args.small or not on_gpu
    cfg = config(small, on_gpu)
    RESULTS["env"] = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "python": platform.python_version(),
        "small": small,
        "interpret": cfg["interpret"],
    }
    print(RESULTS["env"], flush=True)
    failed = False
    for name, fn in (("accuracy", accuracy), ("invariance", invariance)):
        try:
            RESULTS[name] = fn(cfg)
        except Exception as err:  # noqa: BLE001 - report every part, then go on
            traceback.print_exc()
            RESULTS[name] = {"error": f"{type(err).__name__}: {str(err)[:2000]}"}
        dump(name, {"env": RESULTS["env"], name: RESULTS[name]})
        failed |= "error" in RESULTS[name] or not all(r.get("ok") for r in RESULTS[name].values())
    try:
        RESULTS["speed"] = speed(cfg, t_start + args.budget_s)
    except Exception as err:  # noqa: BLE001
        traceback.print_exc()
        RESULTS["speed"] = {"error": f"{type(err).__name__}: {str(err)[:2000]}"}
        failed = True
    dump("speed", RESULTS["speed"])
    summary = table({k: v for k, v in RESULTS.items() if not (isinstance(v, dict) and "error" in v)})
    summary += f"\n== total {time.perf_counter() - t_start:.1f} s, {'FAILED' if failed else 'all checks ok'}"
    (OUT / "summary.txt").write_text(summary + "\n")
    print(summary, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
