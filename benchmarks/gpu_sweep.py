"""Issue 54's device sweep: the GPU kernel variants at decode shapes, checked, timed, the winners
written as tuning data, then the engine's decode re-timed with them. One call, <= 6 minutes.

On a lent H100 / H200 (the repo root; aqtp importable for the quantized engine formats):
    timeout 420 python3 benchmarks/gpu_sweep.py            # OUT=$OUT, default ./out
Here, without a GPU (Pallas' interpreter, tiny shapes, < 2 minutes):
    python benchmarks/gpu_sweep.py --dry-run
Here, compiling every variant for sm_90 with no GPU (XLA's deviceless AOT; see ``--aot``'s help):
    PYTHONPATH=$PWD:/tmp/cudaplug JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/gpu_sweep.py --aot

Stages, each under its own budget:
  dense    per (fmt, K, N) of the Qwen3-1.7B and Qwen3-8B projections (and K=N=8192), the current
           config then the variants of ``VARIANTS`` (magic-number int4 dequantization, split-K, wider
           N tiles, deeper pipelines, swapped operands), round-robin so a budget cut leaves every
           (fmt, shape) its first candidates. Each candidate is compiled for M = 1, 16, 64, run
           once and checked before it is timed (``gpu_tune.check``: the M=64 call's first rows
           within the float64 bound, w8a8 bit-exact, the M=1 and M=16 rows bitwise the M=64 rows);
           a failing one is dropped, never a winner. Timed against XLA's bf16 dot on rotating copies.
  grouped  the MoE kernel's split-K at Qwen3-30B-A3B's expert shapes (128 experts, 16 tokens x top 8):
           accuracy on the first rows, one expert's rows alone bitwise equal to the same rows in the
           batch.
  winners  $OUT/tuned_gpu.json in ``kernels_pallas.matmul.tuned``'s format (commit it beside
           tuned.py as ``tuned_gpu.json`` to make it the kernels' table), $OUT/gpu_sweep.json (all).
  engine   ``benchmarks/rollout.py`` (Qwen3-1.7B shape, batch 16, bf16 / w4a16 / w8a8) in a
           subprocess reading the winners (``QARL_GPU_TUNED``), $OUT/rollout.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import operator
import os
import pathlib
import platform
import subprocess
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gpu_tune import calls_fn, check, nbytes, score, shape_data, time_compiled  # noqa: E402

from kernels_pallas import formats, grouped_matmul, quantized_matmul  # noqa: E402
from kernels_pallas._tiling import Blocks  # noqa: E402
from kernels_pallas.matmul import gpu as gm  # noqa: E402
from kernels_pallas.matmul.reference import reference_matmul  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
QWEN3_1_7B = [(2048, 2048), (2048, 1024), (2048, 6144), (6144, 2048)]  # q/o, k/v, gate/up, down
QWEN3_8B = [(4096, 4096), (4096, 1024), (4096, 12288), (12288, 4096)]
SHAPES = QWEN3_1_7B + QWEN3_8B + [(8192, 8192)]  # the engine's shapes first; 8192: the proof
GROUPED = [(2048, 768, 128), (768, 2048, 128)]  # Qwen3-30B-A3B experts: gate/up, down; E = 128
GROUPED_ROWS = 128  # 16 decode tokens x top 8

_C = dict
# Over each shape's current config (``gm.gpu_blocks``): most promising first.
VARIANTS: dict[str, list[dict]] = {
    "w4a16": [
        _C(dequant="magic"),
        _C(dequant="magic", block_n=128, block_k=256, split_k=4, swap_ab=True),
        _C(dequant="magic", block_n=64, block_k=128, split_k=8, swap_ab=True),
        _C(dequant="magic", block_n=256, block_k=256, num_warps=8, num_stages=3, split_k=4, swap_ab=True),
        _C(dequant="magic", block_n=128, block_k=128, num_stages=5, split_k=4),
        _C(dequant="magic", block_n=64, block_k=256, num_stages=6, split_k=8),
        _C(dequant="magic", block_n=128, block_k=512, num_warps=8, num_stages=3, split_k=2),
    ],
    "w8a8": [
        _C(block_n=128, block_k=128, split_k=4, int_dot="bf16"),
        _C(block_n=128, block_k=128, split_k=4, swap_ab=True, int_dot="bf16"),
        _C(block_n=256, block_k=128, num_warps=8, num_stages=3, split_k=4, swap_ab=True),
        _C(block_n=128, block_k=256, num_stages=5, split_k=8, swap_ab=True),
        _C(block_n=64, block_k=256, num_stages=6, split_k=4),
    ],
    "fp8": [
        _C(block_n=128, block_k=128, split_k=4, swap_ab=True),
        _C(block_n=256, block_k=128, num_warps=8, num_stages=3, split_k=4, swap_ab=True),
        _C(block_n=64, block_k=256, num_stages=5, split_k=4),
        _C(block_n=128, block_k=256, num_stages=4, split_k=8, swap_ab=True),
    ],
    "bf16": [
        _C(block_n=64, block_k=128, split_k=4, swap_ab=True),
        _C(block_n=128, block_k=64, num_stages=5, split_k=4),
        _C(block_n=128, block_k=128, num_warps=8, num_stages=3, split_k=8, swap_ab=True),
    ],
}
GROUPED_VARIANTS = [
    _C(split_k=1),
    _C(split_k=2),
    _C(split_k=4),
    _C(split_k=2, dequant="magic"),
    _C(split_k=4, dequant="magic"),
]
GROUPED_FMTS = ("w4a16", "w8a8")

# XLA's description of an H200 (sm_90, 132 SMs, 227 KB shared memory a block): the --aot target
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150754820096 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""


@dataclasses.dataclass(frozen=True)
class Mode:
    """What a run is: the device sweep, the interpreter's dry run, or deviceless sm_90 compiles."""

    name: str  # "device", "dry-run", "aot"
    shapes: list
    grouped: list
    ms: tuple
    fmts: tuple
    group: int  # int4 group size
    max_per: int | None  # candidates per (fmt, shape), the current config included
    copies: int  # 0: enough to defeat L2
    min_calls: int
    iters: int
    interpret: bool
    grouped_variants: tuple = tuple(GROUPED_VARIANTS)
    budgets: tuple = (140.0, 30.0, 110.0)  # dense, grouped, engine (seconds)


def mode_of(args) -> Mode:
    if args.dry_run:  # a fixed set of work, no budgets: the interpreter's speed is the host's load
        return Mode(
            name="dry-run", shapes=[(256, 128)], grouped=[(128, 64, 4)], ms=(1, 3, 16),
            fmts=("bf16", "w8a8", "w4a16", "fp8"), group=64, max_per=2, copies=2, min_calls=2,
            iters=1, interpret=True, grouped_variants=(GROUPED_VARIANTS[0], GROUPED_VARIANTS[3]),
            budgets=(1e9, 1e9, 20.0),
        )  # fmt: skip
    device = dict(shapes=SHAPES, grouped=GROUPED, fmts=tuple(VARIANTS), group=128, max_per=None)
    timing = dict(copies=0, min_calls=16, iters=20, interpret=False)
    if args.aot:  # one M: the program is the same for every M but for the count of row blocks
        return Mode(name="aot", ms=(16,), **device, **timing)
    return Mode(name="device", ms=(1, 16, 64), **device, **timing)


def candidates(mode: Mode) -> list[tuple[str, int, int, dict]]:
    """(fmt, K, N, full Blocks dict) round-robin over (fmt, shape), duplicates after planning removed."""
    queues = []
    for k, n in mode.shapes:
        for fmt in mode.fmts:
            default = dataclasses.asdict(gm.gpu_blocks(fmt, k, n))
            cands = [default] + [{**default, **c} for c in VARIANTS[fmt]]
            queues.append([(fmt, k, n, c) for c in cands[: mode.max_per]])
    order, seen = [], set()
    while any(queues):
        for q in queues:
            if q:
                fmt, k, n, c = q.pop(0)
                w = abstract_weight(fmt, k, n, mode.group)
                key = (fmt, k, n, gm.plan(w, Blocks(**c)))
                if key not in seen:
                    seen.add(key)
                    order.append((fmt, k, n, c))
    return order


def abstract_weight(fmt: str, k: int, n: int, group: int, experts: int | None = None):
    bits = formats.WEIGHT_BITS[fmt]
    g = group if bits == 4 else k
    dtype = {None: jnp.bfloat16, 8: formats.VALUE_DTYPE.get(fmt), 4: jnp.int8}[bits]
    lead = () if experts is None else (experts,)
    values = jax.ShapeDtypeStruct((*lead, k // 2 if bits == 4 else k, n), dtype)
    scales = None if bits is None else jax.ShapeDtypeStruct((*lead, k // g, n), jnp.float32)
    return formats.QuantizedWeight(values, scales, fmt, g)


def dense_call(cfg: dict, interpret: bool):
    """The public dense matmul on the GPU backend with every Blocks field of ``cfg`` as its knobs."""
    return lambda x, w: quantized_matmul(
        x, w, out_dtype=jnp.float32, backend="gpu", interpret=interpret, **cfg
    )


def sweep_dense(mode: Mode, deadline: float, res: dict, pool, jobs: int) -> None:
    """Time XLA's bf16 dot per shape, then every candidate that passes its checks; candidates in
    batches of ``jobs`` whose compiles run side by side (a thread each)."""
    xs = {k: jax.random.normal(jax.random.key(3), (max(mode.ms), k), jnp.bfloat16) for k, _ in mode.shapes}
    cfg = dict(group=mode.group, copies=mode.copies)
    data: dict = {}  # (fmt, K, N) -> gpu_tune.ShapeData, kept (a few GB at the device shapes)

    def get(fmt: str, k: int, n: int):
        if (fmt, k, n) not in data:
            data[(fmt, k, n)] = shape_data(fmt, k, n, xs[k], cfg)
        return data[(fmt, k, n)]

    for k, n in mode.shapes:
        d = get("bf16", k, n)
        calls = max(len(d.copies), mode.min_calls)
        fn = calls_fn(lambda x, w: jnp.dot(x, w.values, preferred_element_type=jnp.float32), calls)
        us = {str(m): time_compiled(fn, (xs[k][:m], d.copies), mode.iters, calls)[0] * 1e6 for m in mode.ms}
        res["xla_bf16"][f"K={k},N={n}"] = us
        print(f"xla_bf16 K={k},N={n}: { {m: round(t, 1) for m, t in us.items()} }", flush=True)
    queue = candidates(mode)
    while queue:
        if time.perf_counter() > deadline:
            res["not_run"] = [{"fmt": f, "K": k, "N": n, "cfg": c} for f, k, n, c in queue]
            print(f"budget: {len(queue)} candidates not run", flush=True)
            break
        batch, queue = queue[:jobs], queue[jobs:]
        started = []
        for fmt, k, n, c in batch:
            d = get(fmt, k, n)
            calls = max(len(d.copies), mode.min_calls)
            rec: dict = {"fmt": fmt, "K": k, "N": n, "cfg": c}
            try:
                fn = calls_fn(dense_call(c, mode.interpret), calls)
                futs = {m: pool.submit(fn.lower(xs[k][:m], d.copies).compile) for m in mode.ms}
            except Exception as err:  # noqa: BLE001 - one bad candidate must not end the sweep
                rec["error"], futs = f"lower: {type(err).__name__}: {str(err)[:1500]}", {}
            started.append((rec, d, calls, futs))
        for rec, d, calls, futs in started:
            k = rec["K"]
            try:
                if futs:
                    compiled = {m: f.result() for m, f in futs.items()}
                    outs = {m: np.asarray(compiled[m](xs[k][:m], d.copies)[0]) for m in mode.ms}
                    rec["checks"] = check(outs, d)  # correctness first: a failing candidate is not timed
                    rec["ok"] = rec["checks"]["ok"]
                if rec.get("ok"):
                    xla = res["xla_bf16"][f"K={k},N={rec['N']}"]
                    us = {
                        str(m): time_compiled(compiled[m], (xs[k][:m], d.copies), mode.iters, calls)[0] * 1e6
                        for m in mode.ms
                    }
                    rec["us"], rec["score"] = us, score(us, xla)
                    rec["x_xla"] = {m: xla[m] / t for m, t in us.items()}
                    rec["weight_TBps"] = {m: d.nbytes / (t * 1e-6) / 1e12 for m, t in us.items()}
            except Exception as err:  # noqa: BLE001
                rec["error"] = f"{type(err).__name__}: {str(err)[:1500]}"
            res["dense"].append(rec)
            print(summary_line(rec), flush=True)


def describe(rec: dict) -> str:
    """A candidate's shape and its main knobs, for the log."""
    head = f"{rec['fmt']} K={rec['K']} N={rec['N']}" + (f" E={rec['E']}" if "E" in rec else "")
    main = ("block_n", "block_k", "split_k", "num_stages", "swap_ab", "dequant")
    return f"{head} { {k: v for k, v in rec['cfg'].items() if k in main} }"


def summary_line(rec: dict) -> str:
    head = describe(rec)
    if "error" in rec:
        return f"{head}: ERROR {rec['error'][:300]}"
    if not rec.get("ok"):
        return f"{head}: FAILED checks {rec['checks']}"
    speed = (
        " ".join(f"M={m}:{t:.1f}us(x{rec['x_xla'][m]:.2f})" for m, t in rec["us"].items())
        if "x_xla" in rec
        else ""
    )
    return f"{head}: ok {speed or {m: round(t, 1) for m, t in rec['us'].items()}}"


def grouped_sizes(rows: int, experts: int, seed: int = 0) -> np.ndarray:
    """A decode step's routing: ``rows`` (token, expert) pairs spread over the experts at random."""
    hits = np.random.default_rng(seed).integers(0, experts, rows)
    return np.bincount(hits, minlength=experts).astype(np.int32)


def sweep_grouped(mode: Mode, deadline: float, res: dict) -> None:
    """The grouped kernel's split-K variants: checked (accuracy on the first rows' experts, one
    expert's rows alone == the same rows in the batch, bitwise), then timed."""
    rows = GROUPED_ROWS if mode.name != "dry-run" else 16
    for k, n, e in mode.grouped:
        x = jax.random.normal(jax.random.key(5), (rows, k), jnp.bfloat16)
        sizes = grouped_sizes(rows, e)
        first = int(np.flatnonzero(sizes)[0])
        for fmt in GROUPED_FMTS:
            wf = jax.random.normal(jax.random.key(6), (e, k, n), jnp.float32) * k**-0.5
            w = formats.quantize(wf, fmt, mode.group if formats.WEIGHT_BITS[fmt] == 4 else None)
            one = jax.tree.map(operator.itemgetter(first), w)  # the first routed expert's weight
            ref = reference_matmul(np.asarray(x[: sizes[first]].astype(jnp.float32)), one)
            deq = np.abs(np.asarray(formats.dequantize(one), np.float64))
            xa = np.abs(np.asarray(x[: sizes[first]].astype(jnp.float32), np.float64))
            bound = k * 2.0**-23 * (xa + xa.max(-1, keepdims=True) / 127) @ deq + 1e-30
            alone = np.zeros(e, np.int32)
            alone[first] = sizes[first]
            base = None
            for c in mode.grouped_variants:
                rec: dict = {"fmt": fmt, "K": k, "N": n, "E": e, "cfg": c}
                if time.perf_counter() > deadline:
                    res.setdefault("grouped_not_run", []).append(rec)
                    continue
                try:
                    fn = jax.jit(
                        lambda x, w, s, c=c: grouped_matmul(
                            x, w, s, out_dtype=jnp.float32, backend="gpu", interpret=mode.interpret, **c
                        )
                    )
                    y = np.asarray(fn(x, w, jnp.asarray(sizes)))
                    y1 = np.asarray(fn(x[: sizes[first]], w, jnp.asarray(alone)))
                    err = float((np.abs(y[: sizes[first]] - ref) / bound).max())
                    rec["checks"] = {
                        "max_err_over_bound": err,
                        "expert_rows_alone_equal": bool(np.array_equal(y1, y[: sizes[first]])),
                    }
                    if fmt == "w8a8":  # int32 partials: every split gives the same bits
                        base = y if base is None else base
                        rec["checks"]["bitwise_split_1"] = bool(np.array_equal(y, base))
                    rec["ok"] = bool(
                        err <= 1.0 and all(v for v in rec["checks"].values() if isinstance(v, bool))
                    )
                    if rec["ok"]:
                        t, _ = time_compiled(fn, (x, w, jnp.asarray(sizes)), mode.iters, 1)
                        rec["us"] = {str(rows): t * 1e6}
                        rec["weight_TBps"] = nbytes(w) / t / 1e12
                except Exception as err:  # noqa: BLE001
                    rec["error"] = f"{type(err).__name__}: {str(err)[:1500]}"
                res["grouped"].append(rec)
                print(summary_line(rec), flush=True)


def winners(res: dict) -> dict:
    """The tuning JSON: per (fmt, K, N) the passing candidate with the best score (geometric mean
    over M of time / XLA bf16 time), as the fields that differ from the format's base blocks."""
    best: dict[str, dict] = {}
    for r in res["dense"]:
        key = f"{r['fmt']},{r['K']},{r['N']}"
        if r.get("ok") and "score" in r and (key not in best or r["score"] < best[key]["score"]):
            best[key] = r
    fastest: dict[str, dict] = {}
    for r in res["grouped"]:
        key = f"{r['fmt']},{r['K']},{r['N']}"
        if (
            r.get("ok")
            and "us" in r
            and (key not in fastest or min(r["us"].values()) < min(fastest[key]["us"].values()))
        ):
            fastest[key] = r

    def diff(fmt: str, cfg: dict) -> dict:
        base = dataclasses.asdict(gm.base_blocks(fmt))
        return {f: v for f, v in cfg.items() if base.get(f) != v}

    return {
        "env": res["env"],
        "dense": {key: diff(r["fmt"], r["cfg"]) for key, r in sorted(best.items())},
        "grouped": {key: r["cfg"] for key, r in sorted(fastest.items())},
    }


def retime_engine(mode: Mode, out: pathlib.Path, tuned: pathlib.Path, budget_s: float) -> dict:
    """``benchmarks/rollout.py`` in a subprocess reading the winners; its JSON, or why there is none."""
    shape = ["--small-sweep", "--batches", "4", "--formats", "w4a16"] if mode.name == "dry-run" else [
        "--gpu-shape", "--batches", "16", "--formats", "bf16,w4a16,w8a8",
    ]  # fmt: skip
    cmd = [sys.executable, str(ROOT / "benchmarks" / "rollout.py"), *shape, "--budget-s", str(budget_s)]
    cmd += ["--json", str(out / "rollout.json")]
    env = {
        **os.environ,
        "QARL_GPU_TUNED": str(tuned),
        "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
    }
    print("== engine:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, timeout=budget_s + 70, capture_output=True, text=True)
        tail = (proc.stdout + proc.stderr)[-3000:]
        print(tail, flush=True)
        rep = json.loads((out / "rollout.json").read_text()) if (out / "rollout.json").exists() else {}
        return {"rc": proc.returncode, "seconds": time.perf_counter() - t0, "report": rep}
    except subprocess.TimeoutExpired:
        return {"rc": "timeout", "seconds": time.perf_counter() - t0}


def aot(mode: Mode, pool) -> dict:
    """Compile every dense and grouped candidate for sm_90 with no GPU: XLA's deviceless AOT through
    the CUDA PJRT plugin (``jax.experimental.topologies`` with ``H200_TARGET``). Needs the plugin
    importable, not installed in the project's venv (it would register a CUDA backend for every
    process):  pip install --no-deps --target /tmp/cudaplug jax-cuda12-pjrt==$JAX
    jax-cuda12-plugin==$JAX nvidia-cuda-nvcc-cu12  (~220 MB), then PYTHONPATH=$PWD:/tmp/cudaplug
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 (no CUDA runtime here to check). Triton's lowering, its
    shared-memory and register limits and ptx generation all run; only a driver's load is left out."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET, topology="1x1x1")
    mesh = topologies.make_mesh(topo, (1,), ("d",))
    on = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on)
    jobs = []
    for fmt, k, n, c in candidates(mode):
        w = jax.tree.map(spec, abstract_weight(fmt, k, n, mode.group))
        for m in mode.ms:
            x = spec(jax.ShapeDtypeStruct((m, k), jnp.bfloat16))
            jobs.append(({"fmt": fmt, "K": k, "N": n, "M": m, "cfg": c}, dense_call(c, False), (x, w)))
    for k, n, e in mode.grouped:
        for fmt in GROUPED_FMTS:
            w = jax.tree.map(spec, abstract_weight(fmt, k, n, mode.group, experts=e))
            x, s = (
                spec(jax.ShapeDtypeStruct((GROUPED_ROWS, k), jnp.bfloat16)),
                spec(jax.ShapeDtypeStruct((e,), jnp.int32)),
            )
            for c in GROUPED_VARIANTS:
                fn = lambda x, w, s, c=c: grouped_matmul(x, w, s, out_dtype=jnp.float32, backend="gpu", **c)
                jobs.append(({"fmt": fmt, "K": k, "N": n, "E": e, "cfg": c}, fn, (x, w, s)))

    def compile_one(job) -> dict:
        rec, fn, args = job
        t0 = time.perf_counter()
        try:
            jax.jit(fn).lower(*args).compile()
            rec["ok"] = True
        except Exception as err:  # noqa: BLE001
            rec["ok"], rec["error"] = False, f"{type(err).__name__}: {str(err)[:600]}"
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        return rec

    recs = []
    for r in pool.map(compile_one, jobs):
        recs.append(r)
        status = "ok" if r["ok"] else f"FAILED {r['error'][:300]}"
        print(f"aot {len(recs)}/{len(jobs)} {describe(r)}: {status}", flush=True)
    ok = sum(r["ok"] for r in recs)
    print(f"== aot: {ok} of {len(recs)} compiles for sm_90 succeeded", flush=True)
    return {"target": "sm_90 (H200_TARGET)", "compiles": recs, "ok": ok, "total": len(recs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--dry-run", action="store_true", help="CPU, Pallas interpreter, tiny shapes (< 2 min)")
    how.add_argument("--aot", action="store_true", help="compile every variant for sm_90 with no GPU")
    ap.add_argument(
        "--budget-s", type=float, default=None, help="dense sweep budget (default 140; dry run: none)"
    )
    ap.add_argument("--grouped-budget-s", type=float, default=None, help="default 30; dry run: none")
    ap.add_argument(
        "--engine-budget-s", type=float, default=None, help="rollout.py's budget (default 110; dry run 20)"
    )
    ap.add_argument("--no-engine", action="store_true", help="skip re-timing the engine")
    ap.add_argument("--deadline-s", type=float, default=390.0, help="write what there is and exit after this")
    args = ap.parse_args()
    mode = mode_of(args)
    given_budgets = (args.budget_s, args.grouped_budget_s, args.engine_budget_s)
    dry = mode.name == "dry-run"
    if mode.name == "device" and jax.default_backend() != "gpu":
        print(
            f"gpu_sweep.py: no GPU here (JAX backend {jax.default_backend()}); use --dry-run or --aot",
            file=sys.stderr,
        )
        return 2
    out = pathlib.Path(os.environ.get("OUT", "./out"))
    out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    env = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "mode": mode.name,
        "jax": jax.__version__,
        "device": getattr(dev, "device_kind", str(dev)),
        "python": platform.python_version(),
    }
    print("== gpu_sweep", env, flush=True)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, os.cpu_count() or 1)))
    if mode.name == "aot":
        rep = aot(mode, pool)
        (out / "gpu_aot.json").write_text(json.dumps({"env": env, **rep}, indent=1, default=str))
        return 0 if rep["ok"] == rep["total"] else 1
    t0 = time.perf_counter()
    res: dict = {"env": env, "xla_bf16": {}, "dense": [], "grouped": []}

    def hard_stop() -> None:
        """Past the whole budget (a hung compile or engine?): keep what there is and exit."""
        print(f"watchdog: {args.deadline_s} s passed, writing results and exiting", flush=True)
        (out / "tuned_gpu.json").write_text(json.dumps(winners(res), indent=1) + "\n")
        (out / "gpu_sweep.json").write_text(json.dumps(res, indent=1, default=str))
        os._exit(3)

    watchdog = threading.Timer(args.deadline_s, hard_stop)
    watchdog.daemon = True
    watchdog.start()
    budgets = [given or default for given, default in zip(given_budgets, mode.budgets, strict=True)]
    sweep_dense(mode, t0 + budgets[0], res, pool, jobs=1 if dry else 5)
    t1 = time.perf_counter()
    sweep_grouped(mode, t1 + budgets[1], res)
    tuned = winners(res)
    (out / "tuned_gpu.json").write_text(json.dumps(tuned, indent=1) + "\n")
    (out / "gpu_sweep.json").write_text(json.dumps(res, indent=1, default=str))
    failed = [r for r in res["dense"] + res["grouped"] if not r.get("ok")]
    ran = f"{len(res['dense'])} dense + {len(res['grouped'])} grouped candidates run"
    print(f"== sweep: {ran}, {len(failed)} dropped (check or error), {time.perf_counter() - t0:.0f} s")
    print(
        "== winners ($OUT/tuned_gpu.json):\n"
        + json.dumps({k: tuned[k] for k in ("dense", "grouped")}, indent=1),
        flush=True,
    )
    if not args.no_engine:
        res["engine"] = retime_engine(
            mode, out, out / "tuned_gpu.json", args.engine_budget_s or (20 if dry else 110)
        )
        (out / "gpu_sweep.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"== done in {time.perf_counter() - t0:.0f} s; files in {out}", flush=True)
    return 0 if tuned["dense"] else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # do not wait for a compile thread that outlived the budget
