"""Sweep a small set of GPU (Pallas-Triton) block configs per format at decode shapes; keep the best.

Run on the H200 (default budget 150 s, compile included):
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_tune.py
Run here first (CPU, Pallas interpret mode, tiny shapes):
    python benchmarks/gpu_tune.py --small

For each (fmt, K, N) of K=N=4096 and K=2048,N=6144, candidates (the table's current config first)
are taken round-robin across formats and shapes, so a budget cut leaves every format its most
likely configs. Each candidate is compiled (several at once, in threads), then for M = 1, 16, 64:
  1. timed against rotating weight copies (enough that the 60 MB L2 cannot hold them), per matmul;
  2. checked: the M=64 call's first rows against ``reference_matmul`` (f32-accumulation
     bound; w8a8 bit-exact against the int64 accumulator scaled as the kernel promises), and row
     invariance: the M=1 and M=16 calls' rows bitwise equal to the M=64 call's rows.
Only candidates passing every check can win. Written to $OUT (default ./out) after each batch:
gpu_tune.json (everything, with XLA bf16 per shape) and tuned.py (the winners, in the format of
``kernels_pallas/matmul/tuned.py``: paste its TUNED entries there). Outputs are f32 for every kernel
and for XLA's bf16 dot (bf16 in, f32 out). Imports only jax, numpy, kernels_pallas and the sibling
``gpu_kernels_check`` (its timer).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import pathlib
import platform
import sys
import threading
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gpu_kernels_check import timed  # noqa: E402 - a sibling script: this file's folder is sys.path[0]

from kernels_pallas import formats, quantized_matmul, reference_matmul  # noqa: E402
from kernels_pallas._tiling import Blocks  # noqa: E402
from kernels_pallas.matmul import gpu as gm  # noqa: E402

OUT = pathlib.Path(os.environ.get("OUT", "./out"))
L2_BYTES = 60 * 2**20
CHECK_ROWS = 8  # rows of the M=64 call checked against the float64 reference

# Candidate overrides per format, most promising first (the table's current config is tried before
# these). plan() lowers split_k / block_k where a shape cannot take them; duplicates are skipped.
_C = dict
CANDIDATES: dict[str, list[dict]] = {
    "bf16": [
        _C(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=1),  # no split-K: the control
        _C(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=2),
        _C(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=4, swap_ab=True),
        _C(block_n=128, block_k=64, num_warps=4, num_stages=4, split_k=4),
        _C(block_n=128, block_k=128, num_warps=8, num_stages=3, split_k=4, swap_ab=True),
        _C(block_n=32, block_k=256, num_warps=4, num_stages=3, split_k=2),
    ],
    "w8a8": [
        _C(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=1),
        _C(block_n=128, block_k=128, num_warps=4, num_stages=4, split_k=4, int_dot="bf16"),
        _C(block_n=128, block_k=128, num_warps=4, num_stages=4, split_k=4, swap_ab=True),
        _C(block_n=128, block_k=128, num_warps=4, num_stages=4, split_k=4, swap_ab=True, int_dot="bf16"),
        _C(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=4, int_dot="bf16"),
        _C(block_n=128, block_k=256, num_warps=8, num_stages=3, split_k=2),
        _C(block_n=256, block_k=128, num_warps=8, num_stages=3, split_k=4, swap_ab=True, int_dot="bf16"),
    ],
    "w4a16": [
        _C(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=1),
        _C(block_n=128, block_k=256, num_warps=4, num_stages=4, split_k=4, swap_ab=True),
        _C(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=4),
        _C(block_n=128, block_k=128, num_warps=4, num_stages=5, split_k=4),
        _C(block_n=256, block_k=256, num_warps=8, num_stages=3, split_k=4, swap_ab=True),
        _C(block_n=128, block_k=512, num_warps=8, num_stages=3, split_k=2),
        _C(block_n=64, block_k=128, num_warps=4, num_stages=4, split_k=8, swap_ab=True),
        _C(block_n=128, block_k=256, num_warps=8, num_stages=4, split_k=4),
        _C(block_m=64, block_n=128, block_k=256, num_warps=4, num_stages=3, split_k=4, swap_ab=True),
    ],
    "w4a8": [
        _C(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=1),
        _C(block_n=128, block_k=256, num_warps=4, num_stages=4, split_k=4, int_dot="bf16"),
        _C(block_n=128, block_k=256, num_warps=4, num_stages=4, split_k=4, swap_ab=True, int_dot="bf16"),
        _C(block_n=64, block_k=256, num_warps=4, num_stages=4, split_k=4),
    ],
}


def make_weight(key, k: int, n: int, fmt: str, group: int | None) -> formats.QuantizedWeight:
    w = jax.random.normal(key, (k, n), jnp.float32) * (k**-0.5)
    group = group if formats.WEIGHT_BITS[fmt] == 4 else None
    return formats.quantize(w.astype(jnp.bfloat16) if fmt == "bf16" else w, fmt, group)


def nbytes(w: formats.QuantizedWeight) -> int:
    return w.values.nbytes + (0 if w.scales is None else w.scales.nbytes)


@dataclasses.dataclass
class ShapeData:
    """Per (fmt, K, N): rotating weight copies (copy 0 is checked), and its reference rows."""

    copies: list
    nbytes: int
    ref: np.ndarray  # float64 [CHECK_ROWS, N]
    bound: np.ndarray  # f32-accumulation error bound, same shape
    exact: np.ndarray | None  # w8a8: the kernel's promised f32 bits


def shape_data(fmt: str, k: int, n: int, x: jax.Array, cfg: dict) -> ShapeData:
    base = make_weight(jax.random.key(7), k, n, fmt, cfg["group"])
    size = nbytes(base)
    count = cfg["copies"] or int(min(32, max(4, -(-3 * L2_BYTES // size))))
    keys = jax.random.split(jax.random.key(11), count - 1)
    copies = [base] + [make_weight(kk, k, n, fmt, cfg["group"]) for kk in keys]
    xr = x[:CHECK_ROWS]
    xf = np.asarray(xr.astype(jnp.float32), np.float64)
    ref = reference_matmul(xf, base)
    xa = np.abs(xf) if formats.ACT_BITS[fmt] is None else np.abs(xf) + np.abs(xf).max(-1, keepdims=True) / 127
    bound = k * 2.0**-23 * (xa @ np.abs(np.asarray(formats.dequantize(base), np.float64))) + 1e-30
    exact = None
    if fmt == "w8a8":
        xq, sx = (np.asarray(a) for a in formats.quantize_activations(xr))
        acc = xq.astype(np.int64) @ np.asarray(base.values, np.int64)
        exact = (acc.astype(np.float32) * sx.astype(np.float32)) * np.asarray(base.scales, np.float32)
    return ShapeData(copies, size, ref, bound, exact)


def calls_fn(one, calls: int):
    """One jit running ``calls`` matmuls over the rotating copies; returns copy 0's output first."""
    return jax.jit(lambda x, cs: [one(x, cs[c % len(cs)]) for c in range(calls)])


def time_compiled(fn, args, iters: int, calls: int) -> tuple[float, jax.Array]:
    """Seconds per matmul (:func:`gpu_kernels_check.timed` over ``calls`` matmuls a run) and copy
    0's output."""
    seconds, out = timed(fn, args, iters)
    return seconds / calls, out[0]


def check(outs: dict[int, np.ndarray], data: ShapeData) -> dict:
    big = max(outs)
    y = outs[big][:CHECK_ROWS].astype(np.float64)
    r = {"max_err_over_bound": float((np.abs(y - data.ref) / data.bound).max())}
    if data.exact is not None:
        r["bit_exact_w8a8"] = bool(np.array_equal(outs[big][:CHECK_ROWS], data.exact))
    for m, o in outs.items():
        if m != big:
            r[f"rows_M={m}_equal_M={big}"] = bool(np.array_equal(o, outs[big][:m]))
    r["ok"] = bool(r["max_err_over_bound"] <= 1.0 and all(v for v in r.values() if isinstance(v, bool)))
    return r


def candidate_queue(fmts, shapes, max_per: int | None) -> list[tuple[str, int, int, dict]]:
    """Round-robin over (fmt, shape): every format's first configs come before anyone's last."""
    queues = []
    for k, n in shapes:
        for fmt in fmts:
            default = dataclasses.asdict(gm.gpu_blocks(fmt, k, n))
            cands = [default] + [{**default, **c} for c in CANDIDATES[fmt]]
            queues.append([(fmt, k, n, c) for c in cands[:max_per]])
    order = []
    while any(queues):
        for q in queues:
            if q:
                order.append(q.pop(0))
    return order


def resolved_key(fmt: str, k: int, n: int, cfg: dict, group: int) -> tuple:
    g = group if formats.WEIGHT_BITS[fmt] == 4 else k
    k_rows = k // 2 if formats.WEIGHT_BITS[fmt] == 4 else k
    dtype = jnp.bfloat16 if fmt == "bf16" else jnp.int8
    scales = None if fmt == "bf16" else jax.ShapeDtypeStruct((k // g, n), jnp.float32)
    w = formats.QuantizedWeight(jax.ShapeDtypeStruct((k_rows, n), dtype), scales, fmt, g)
    return (fmt, k, n, gm.plan(w, Blocks(**cfg)))


def score(us: dict, xla: dict) -> float:
    """Geometric mean over M of time / XLA bf16 time (lower is better)."""
    return math.exp(np.mean([math.log(us[m] / xla[m]) for m in us]))


def write(res: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    best = {}
    for r in res["results"]:
        if not r.get("ok"):
            continue
        key = f"{r['fmt']},{r['K']},{r['N']}"
        if key not in best or r["score"] < best[key]["score"]:
            best[key] = {k: r[k] for k in ("cfg", "us", "x_xla", "weight_TBps", "score")}
    res["best"] = best
    (OUT / "gpu_tune.json").write_text(json.dumps(res, indent=1, default=str))
    lines = [
        '"""H200-measured block configs per (fmt, K, N) (written by benchmarks/gpu_tune.py)."""',
        "",
        "from __future__ import annotations",
        "",
        "TUNED: dict[tuple[str, int, int], dict[str, int | bool | str]] = {",
    ]
    for key, b in sorted(best.items()):  # one line an entry: what differs from the format's base
        fmt, k, n = key.split(",")
        base = dataclasses.asdict(gm.base_blocks(fmt))
        diff = ", ".join(f"{f}={v!r}" for f, v in b["cfg"].items() if base.get(f) != v)
        lines.append(f'    ("{fmt}", {k}, {n}): dict({diff}),')
    lines.append("}")
    (OUT / "tuned.py").write_text("\n".join(lines) + "\n")


def table(res: dict) -> str:
    ms = res["env"]["ms"]
    head = "".join(f"{'M=' + str(m):>22}" for m in ms)
    lines = [f"== us per matmul (x XLA bf16) [weight TB/s]; f32 out{'':<10}{head}"]
    for shape, xla in res["xla_bf16"].items():
        lines.append(f"{'xla_bf16 ' + shape:<42}" + "".join(f"{xla[str(m)]:>22.1f}" for m in ms))
        for fmt in res["env"]["fmts"]:
            rows = [r for r in res["results"] if r["fmt"] == fmt and f"K={r['K']},N={r['N']}" == shape]
            key = shape.replace("K=", "").replace("N=", "")
            best = res["best"].get(f"{fmt},{key}")
            for tag, r in (("default", rows[0] if rows else None), ("best", best)):
                if r is None or "us" not in r:
                    continue
                cells = "".join(
                    f"{r['us'][str(m)]:>8.1f} (x{r['x_xla'][str(m)]:.2f}) [{r['weight_TBps'][str(m)]:.2f}]"
                    for m in ms
                )
                lines.append(f"{fmt + ' ' + tag:<42}{cells}")
            if best:
                lines.append(f"{'':<4}best cfg: {best['cfg']}")
    ok = sum(bool(r.get("ok")) for r in res["results"])
    lines.append(f"== {len(res['results'])} candidates run, {ok} passed every check")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes, Pallas interpret mode (CPU proof run)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="no new batch starts after this (total)")
    ap.add_argument("--jobs", type=int, default=4, help="candidates per compile batch (a thread per module)")
    ap.add_argument("--fmts", default=",".join(formats.FORMATS))
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--max-per", type=int, default=None, help="candidates per (fmt, shape), default all")
    args = ap.parse_args()
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    on_gpu = jax.default_backend() == "gpu"
    small = args.small or not on_gpu
    fmts = [f for f in args.fmts.split(",") if f]
    ms = sorted(int(m) for m in args.ms.split(","))
    if small:
        cfg = dict(shapes=[(256, 128)], group=64, copies=2, min_calls=2, iters=2)
        max_per = args.max_per or 2
    else:
        cfg = dict(shapes=[(4096, 4096), (2048, 6144)], group=128, copies=0, min_calls=16, iters=20)
        max_per = args.max_per
    interpret = not on_gpu
    jobs = max(1, args.jobs)
    res: dict = {
        "env": {
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()],
            "python": platform.python_version(),
            "small": small,
            "interpret": interpret,
            "fmts": fmts,
            "ms": ms,
            "jobs": jobs,
        },
        "xla_bf16": {},
        "results": [],
    }
    print(res["env"], flush=True)

    def hard_stop() -> None:
        """Past the budget by a minute (a hung compile?): save what there is and exit."""
        print("watchdog: budget + 60 s passed, writing results and exiting", flush=True)
        try:
            write(res)
        finally:
            os._exit(2)

    watchdog = threading.Timer(args.budget_s + 60.0, hard_stop)
    watchdog.daemon = True
    watchdog.start()
    xs = {k: jax.random.normal(jax.random.key(3), (max(ms), k), jnp.bfloat16) for k, _ in cfg["shapes"]}
    data: dict = {}

    def get_data(fmt, k, n) -> ShapeData:
        if (fmt, k, n) not in data:
            data[(fmt, k, n)] = shape_data(fmt, k, n, xs[k], cfg)
        return data[(fmt, k, n)]

    for k, n in cfg["shapes"]:
        d = get_data("bf16", k, n)
        calls = max(len(d.copies), cfg["min_calls"])
        xla = lambda x, w: jnp.dot(x, w.values, preferred_element_type=jnp.float32)
        fn = calls_fn(xla, calls)
        us = {str(m): time_compiled(fn, (xs[k][:m], d.copies), cfg["iters"], calls)[0] * 1e6 for m in ms}
        res["xla_bf16"][f"K={k},N={n}"] = us
        print(f"xla_bf16 K={k} N={n}: {us}", flush=True)

    seen: set = set()
    queue = []
    for fmt, k, n, c in candidate_queue(fmts, cfg["shapes"], max_per):
        try:
            key = resolved_key(fmt, k, n, c, cfg["group"])
        except ValueError as err:
            res["results"].append({"fmt": fmt, "K": k, "N": n, "cfg": c, "error": f"plan: {err}"})
            continue
        if key not in seen:
            seen.add(key)
            queue.append((fmt, k, n, c, key[-1]))
    print(f"{len(queue)} candidates queued", flush=True)

    threads = max(1, min(os.cpu_count() or 1, jobs * len(ms)))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
    batch_s = 0.0
    while queue:
        now = time.perf_counter()
        if now + batch_s > deadline:
            print(f"budget: {len(queue)} candidates not run", flush=True)
            res["not_run"] = [{"fmt": f, "K": k, "N": n, "cfg": c} for f, k, n, c, _ in queue]
            break
        batch, queue = queue[:jobs], queue[jobs:]
        jobs_in = []
        for fmt, k, n, c, tiling in batch:
            d = get_data(fmt, k, n)
            calls = max(len(d.copies), cfg["min_calls"])
            one = lambda x, w, c=c: quantized_matmul(
                x, w, out_dtype=jnp.float32, backend="gpu", interpret=interpret, **c
            )
            fn = calls_fn(one, calls)
            rec = {"fmt": fmt, "K": k, "N": n, "cfg": c, "tiling": dataclasses.asdict(tiling)}
            try:
                lowered = {m: fn.lower(xs[k][:m], d.copies) for m in ms}
                futs = {m: pool.submit(lo.compile) for m, lo in lowered.items()}
            except Exception as err:  # noqa: BLE001 - one bad candidate must not end the sweep
                rec["error"] = f"lower: {type(err).__name__}: {str(err)[:1500]}"
                futs = None
            jobs_in.append((rec, d, calls, futs))
        for rec, d, calls, futs in jobs_in:
            k = rec["K"]
            if futs is not None:
                try:
                    t0 = time.perf_counter()
                    left = max(5.0, deadline + 30.0 - time.perf_counter())
                    compiled = {m: f.result(timeout=left) for m, f in futs.items()}
                    rec["compile_wait_s"] = time.perf_counter() - t0
                    outs, us = {}, {}
                    for m in ms:
                        t, y = time_compiled(compiled[m], (xs[k][:m], d.copies), cfg["iters"], calls)
                        us[str(m)], outs[m] = t * 1e6, np.asarray(y)
                    rec["checks"] = check(outs, d)
                    rec["ok"] = rec["checks"]["ok"]
                    xla = res["xla_bf16"][f"K={k},N={rec['N']}"]
                    rec["us"] = us
                    rec["x_xla"] = {m: xla[m] / t for m, t in us.items()}
                    rec["weight_TBps"] = {m: d.nbytes / (t * 1e-6) / 1e12 for m, t in us.items()}
                    rec["score"] = score(us, xla)
                except Exception as err:  # noqa: BLE001
                    traceback.print_exc()
                    rec["error"] = f"{type(err).__name__}: {str(err)[:1500]}"
            res["results"].append(rec)
            msg = rec.get("error") or (
                f"ok={rec['ok']} us={ {m: round(t, 1) for m, t in rec['us'].items()} } "
                f"x_xla={ {m: round(v, 2) for m, v in rec['x_xla'].items()} }"
            )
            print(f"{rec['fmt']} K={k} N={rec['N']} {rec['cfg']}: {msg}", flush=True)
        batch_s = time.perf_counter() - now
        write(res)
    pool.shutdown(wait=False, cancel_futures=True)
    watchdog.cancel()
    write(res)
    summary = table(res) + f"\n== total {time.perf_counter() - t_start:.1f} s"
    (OUT / "gpu_tune.txt").write_text(summary + "\n")
    print(summary, flush=True)
    print(f"paste into kernels_pallas/matmul/tuned.py:\n{(OUT / 'tuned.py').read_text()}", flush=True)
    return 0 if any(r.get("ok") for r in res["results"]) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # do not wait for a compile thread that outlived the budget
