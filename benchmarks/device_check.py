"""Stages and summary of ``benchmarks/device_check.sh`` (the GPU evidence, in one device call).

    python benchmarks/device_check.py kernels   --out FILE [--small]
    python benchmarks/device_check.py alignment --out FILE [--small] [--budget-s S] [--cells M:F,...]
    python benchmarks/device_check.py layouts   --out FILE [--small]
    python benchmarks/device_check.py summary   --dir OUT --mode gpu|cpu [--stages FILE]

``kernels``: the Pallas kernels' accuracy and row-wise batch invariance (``gpu_kernels_check``'s
parts, bf16 / w8a8 / w4a16, dense and grouped MoE), then AQT TRAIN == SERVE: the repo's AQT quantizer
(``qarl_jax.quant.aqt``) against ``kernels_pallas.formats`` bit for bit, and the training forward
(float master weights, quantized on the fly under the STE) against the rollout's (weights frozen by
``quantize_params``) at another batch size, bitwise. ``alignment``: ``check_alignment`` on the tiny
dense and MoE presets (random weights): every aligned cell, then naive ones while a budget lasts.
``layouts`` (2+ devices): the tensor-parallel rollout against FSDP training, bitwise, and a decode
step on the engine's replicated layout against one on the training layout.
``summary``: one line per GPU target (measured, target, met) from the stages' JSON files;
it imports no JAX, so it runs whatever the stages left behind. Each stage rewrites its file after
every part, so a stage killed at its time limit keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import traceback

from qarl_jax.cli import plain

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORMATS = ("bf16", "w8a8", "w4a16", "w4a8")
MODELS = ("qwen3-tiny", "qwen3-moe-tiny")
FILES = {  # stage -> result file in $OUT, in the order the stages run
    "kernels": "a_kernels.json",
    "alignment": "b_alignment.json",
    "kernel_speed": "c_kernels.json",
    "rollout": "c_rollout.json",
    "hf": "c_hf.json",
    "train_step": "c_train_step.json",
    "layouts": "d_layouts.json",
}
PEAK_TBPS = 3.7  # H200 HBM bandwidth (TB/s), the base of the 60 % target
ALIGN_SIZES = {  # check_alignment overrides: a short run (compile dominates on either backend)
    "gpu": [
        "alignment.prompts=4",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=16",
        "rollout.slots=8",
        "alignment.max_prompt_len=16",  # one prefill bucket: fewer programs to compile
        "alignment.train_rows=4",
    ],
    "cpu": [
        "alignment.prompts=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=6",
        "rollout.slots=4",
        "alignment.max_prompt_len=8",
        "alignment.train_rows=2",
        "model.num_hidden_layers=2",  # the MoE preset's layer 0 is dense: 2 keeps one MoE layer
    ],
}


def _write(path: pathlib.Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str))


def _error(err: Exception) -> dict:
    traceback.print_exc()
    return {"error": f"{type(err).__name__}: {str(err)[:2000]}"}


# ---------------------------------------------------------------------------------------- kernels


def _aqt_weight(shape: tuple[int, ...], qmax: int, group: int, seed: int):
    """Normal weights plus the quantizer's hard columns: all zero (scale 1), an outlier, and values
    on half-integers of their group's scale (dividing by the scale and multiplying by its
    reciprocal round those differently, so only the same op gives the same integers)."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    w[..., 0] = 0.0
    w[..., 1] *= 1e4
    k = shape[-2]
    absmax = rng.uniform(0.5, 2.0, (*shape[:-2], k // group, 1)).astype(np.float32)
    halves = rng.integers(-qmax, qmax, (*shape[:-2], k // group, group)).astype(np.float32) + 0.5
    tie = halves * (absmax / np.float32(qmax))
    tie[..., 0] = absmax[..., 0]
    w[..., 2] = tie.reshape(*shape[:-2], k)
    return jnp.asarray(w)


def aqt_train_serve(small: bool) -> dict:
    """AQT quantizer == formats.quantize bitwise, and TRAIN (master weights, on-the-fly AQT under
    the STE, all rows) == SERVE (frozen weights, the first rows only) bitwise, dense and grouped."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kernels_pallas as kp
    from qarl_jax import quant
    from qarl_jax.quant import aqt as qaqt

    k, n, e, ke, ne = (256, 128, 4, 256, 64) if small else (2048, 768, 8, 512, 256)
    m_train, m_serve = 64, 16
    x = jax.random.normal(jax.random.key(0), (m_train, k), jnp.float32)
    xe = jax.random.normal(jax.random.key(1), (m_train, ke), jnp.float32)
    sizes = jnp.asarray([m_train // 2, 0, m_train // 4, m_train // 4] + [0] * (e - 4), jnp.int32)
    serve_sizes = jnp.asarray([m_serve] + [0] * (e - 1), jnp.int32)
    out = {}
    for fmt in FORMATS:
        spec = quant.QuantSpec(fmt)
        g = kp.resolve_group_size(fmt, k, None)
        qmax = 127 if fmt == "w8a8" else 7
        w = _aqt_weight((k, n), qmax, g, seed=10)
        we = _aqt_weight((e, ke, ne), qmax, kp.resolve_group_size(fmt, ke, None), seed=11)
        r = {}
        if fmt != "bf16":
            for name, ww in (("dense", w), ("experts", we)):
                got = jax.jit(qaqt.quantize, static_argnums=1)(ww, fmt)
                want = jax.jit(kp.quantize, static_argnums=1)(ww, fmt)
                r[f"aqt_equals_formats_{name}"] = bool(
                    np.array_equal(np.asarray(got.values), np.asarray(want.values))
                    and np.array_equal(
                        np.asarray(got.scales).view(np.uint32), np.asarray(want.scales).view(np.uint32)
                    )
                )
        frozen = quant.quantize_params({"mlp": {"up_proj": {"kernel": w}}, "experts": {"w": we}}, spec)

        def train_dense(w, spec=spec):
            return jax.vjp(lambda w: quant.dot(x, w, spec, "mlp"), w)[0]

        def train_grouped(w, spec=spec):
            return jax.vjp(lambda w: quant.grouped_dot(xe, w, sizes, spec), w)[0]

        serve_dense = jax.jit(lambda x, w, spec=spec: quant.dot(x, w, spec, "mlp"))
        serve_grouped = jax.jit(lambda x, w, s, spec=spec: quant.grouped_dot(x, w, s, spec))
        y_train = np.asarray(jax.jit(train_dense)(w))[:m_serve]
        y_serve = np.asarray(serve_dense(x[:m_serve], frozen["mlp"]["up_proj"]["kernel"]))
        r["train_equals_serve_dense"] = bool(np.array_equal(y_train, y_serve))
        # expert 0's first m_serve rows: beside 16 more of its rows and two other experts' rows in
        # training, alone in serving
        ye_train = np.asarray(jax.jit(train_grouped)(we))[:m_serve]
        ye_serve = np.asarray(serve_grouped(xe[:m_serve], frozen["experts"]["w"], serve_sizes))
        r["train_equals_serve_grouped"] = bool(np.array_equal(ye_train, ye_serve))
        r["ok"] = all(r.values())
        out[fmt] = r
        print(f"aqt {fmt}: {r}", flush=True)
    return out


def kernels(out: pathlib.Path, small: bool) -> int:
    """Stage a: kernel accuracy and invariance (gpu_kernels_check), then AQT TRAIN == SERVE."""
    import gpu_kernels_check as gkc  # a sibling script: this file's folder is sys.path[0]
    import jax

    on_gpu = jax.default_backend() == "gpu"
    small = small or not on_gpu
    cfg = gkc.config(small, on_gpu) | {"formats": FORMATS}
    result = {"backend": jax.default_backend(), "jax": jax.__version__, "interpret": cfg["interpret"]}
    parts = {
        "accuracy": lambda: gkc.accuracy(cfg),
        "invariance": lambda: gkc.invariance(cfg),
        "aqt": lambda: aqt_train_serve(small),
    }
    for name, part in parts.items():
        start = time.perf_counter()
        try:
            result[name] = part()
        except Exception as err:  # noqa: BLE001 - report every part, then go on
            result[name] = _error(err)
        result[f"{name}_s"] = round(time.perf_counter() - start, 1)
        _write(out, result)
    return 0


# -------------------------------------------------------------------------------------- alignment


def cell_name(model: str, fmt: str, temperature: float = 1.0) -> str:
    return f"{model}:{fmt}" + ("" if temperature == 1.0 else f":{temperature:g}")


def alignment(out: pathlib.Path, small: bool, budget_s: float, cells: list[tuple[str, str, float]]) -> int:
    """Stage b: check_alignment per (mode, model, format, sampling temperature): every aligned cell
    (the evidence), then the naive ones at temperature 1 (reported only) while ``budget_s`` lasts."""
    import jax

    from qarl_jax.config import load_config
    from qarl_jax.tools import check_alignment

    start = time.perf_counter()
    sizes = ALIGN_SIZES["cpu" if small or jax.default_backend() == "cpu" else "gpu"]
    result: dict = {"backend": jax.default_backend(), "jax": jax.__version__, "overrides": sizes}
    result |= {"planned": [cell_name(*c) for c in cells], "cells": []}
    for mode in ("aligned", "naive"):
        for model, fmt, temperature in cells:
            if mode == "naive" and temperature != 1.0:
                continue
            cell = {"mode": mode, "model": model, "format": fmt, "temperature": temperature}
            if mode == "naive" and time.perf_counter() - start > budget_s:
                result["cells"].append(cell | {"skipped": "not started (time budget)"})
                continue
            t = time.perf_counter()
            overrides = ["model.path=null", f"model.preset={model}", f"quant.fmt={fmt}", f"quant.mode={mode}"]
            overrides += [f"rollout.temperature={temperature}", f"train.temperature={temperature}"]
            try:
                report = check_alignment.run(load_config(None, overrides + sizes), progress=False)
                cell |= {k: report[k] for k in check_alignment.KEYS if k not in ("format", "mode")}
            except Exception as err:  # noqa: BLE001 - one failing cell must not hide the others
                cell |= _error(err)
            cell["seconds"] = round(time.perf_counter() - t, 1)
            result["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            _write(out, result)
    _write(out, result)
    return 0


def layouts(out: pathlib.Path, small: bool) -> int:
    """Stage d, for 2+ devices: the rollout engine on its own layouts. Bitwise: check_alignment with
    the engine tensor-parallel (tensor 2 x data n/2; qwen3-moe-tiny, bf16 compute, w4a16) against
    the training forward on FSDP over every device. Speed: one decode step on the engine's replicated
    layout against decoding on the training (FSDP) layout, which gathers every frozen weight."""
    import jax

    from qarl_jax import sharding
    from qarl_jax.config import load_config
    from qarl_jax.models import Qwen3ForCausalLM, init_sharded, preset
    from qarl_jax.quant import QuantSpec
    from qarl_jax.rollout import EngineConfig, RolloutEngine, layout
    from qarl_jax.tools import check_alignment

    n = jax.device_count()
    result: dict = {"backend": jax.default_backend(), "devices": n}
    if n < 2 or n % 2:
        _write(out, result | {"skipped": f"needs an even number (2+) of devices, {n} here"})
        return 0
    sizes = ALIGN_SIZES["cpu" if small or jax.default_backend() == "cpu" else "gpu"]
    overrides = ["model.path=null", "model.preset=qwen3-moe-tiny", "model.compute_dtype=bfloat16"]
    overrides += ["mesh.data=1", f"mesh.fsdp={n}", "rollout.mesh.tensor=2", f"rollout.mesh.data={n // 2}"]
    try:
        report = check_alignment.run(load_config(None, overrides + sizes), progress=False)
        result["tensor2"] = {k: report[k] for k in ("n_tokens", "frac_bitwise_equal", "frac_same_experts")}
    except Exception as err:  # noqa: BLE001 - the speed part still runs
        result["tensor2"] = _error(err)
    _write(out, result)
    shape = dict(num_hidden_layers=2) if small else dict(num_hidden_layers=4)
    model = Qwen3ForCausalLM(
        preset("qwen3-small" if small else "qwen3-1.7b", dtype="bfloat16", **shape), QuantSpec("w4a16")
    )
    fsdp = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=n))
    with sharding.activate(fsdp):
        frozen = jax.jit(lambda p: layout.freeze(p, model.quant, model))(
            init_sharded(model, jax.random.key(0), fsdp)
        )
    config = EngineConfig(slots=8 * n, max_len=256)
    replicated = layout.engine_mesh(layout.RolloutMesh(), jax.devices())
    result["decode_ms"] = {}
    for name, mesh, rules in (
        ("fsdp", fsdp, sharding.DEFAULT_RULES),
        ("replicated", replicated, layout.ENGINE_RULES),
    ):
        engine = RolloutEngine(model, frozen, config, mesh=mesh, rules=rules)
        state = engine.allocate()
        times = []
        for _ in range(12):
            t = time.perf_counter()
            state, step = engine.generate(engine.params, state)
            jax.block_until_ready(step.tokens)
            times.append(time.perf_counter() - t)
        engine.state = state
        engine.release()
        result["decode_ms"][name] = round(1e3 * sorted(times[2:])[len(times[2:]) // 2], 3)  # median, warm
        _write(out, result)
    ms = result["decode_ms"]
    result["fsdp_over_replicated"] = round(ms["fsdp"] / ms["replicated"], 2)
    _write(out, result)
    return 0


# ---------------------------------------------------------------------------------------- summary

Row = tuple[str, str, str, str]
HEADER: Row = ("what", "measured", "target", "met")


def _load(out_dir: pathlib.Path, stage: str) -> dict:
    try:
        return json.loads((out_dir / FILES[stage]).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _why(stage: str, ran: dict[str, str]) -> str:
    """Why ``stage`` left no result: skipped at the deadline, killed at its limit, failed, or ended
    without reaching it within its budget."""
    rc = ran.get(stage, "?")
    known = {
        "0": "not reached within the stage's budget",
        "skipped": "stage skipped (deadline)",
        "124": "killed at its time limit",
        "137": "killed",
    }
    return known.get(rc, f"stage failed (rc {rc})")


def _yes(ok: bool) -> str:
    return "yes" if ok else "no"


def _judge(value: float | None, target: float, at_least: bool, judged: bool) -> str:
    if value is None:
        return "n/a"
    if not judged:
        return "n/a (cpu)"
    return _yes(value >= target if at_least else value <= target)


def _kernel_rows(out_dir: pathlib.Path, ran: dict[str, str]) -> list[Row]:
    a, rows = _load(out_dir, "kernels"), []
    for part, what in (("accuracy", "kernel accuracy"), ("invariance", "kernel row invariance")):
        what += " (" + "/".join(FORMATS) + " + grouped)"
        res = a.get(part, {"error": _why("kernels", ran)})
        if "error" in res:
            rows.append((what, res["error"][:70], "all ok", "no"))
            continue
        ok = sum(bool(r.get("ok")) for r in res.values())
        rows.append((what, f"{ok}/{len(res)} ok", "all ok", _yes(ok == len(res))))
    aqt = a.get("aqt", {"error": _why("kernels", ran)})
    if "error" in aqt:
        return rows + [("AQT TRAIN == SERVE", aqt["error"][:70], "bitwise", "no")]
    for fmt, r in aqt.items():
        checks = [v for k, v in r.items() if k != "ok"]
        measured = f"{sum(checks)}/{len(checks)} bitwise"
        rows.append((f"AQT TRAIN == SERVE, quantizer == formats: {fmt}", measured, "bitwise", _yes(r["ok"])))
    return rows


def _alignment_rows(out_dir: pathlib.Path, ran: dict[str, str]) -> list[Row]:
    b = _load(out_dir, "alignment")
    if not b:
        return [("aligned bitwise (dense + MoE)", _why("alignment", ran), "frac 1.0", "no")]
    done = {
        cell_name(c["model"], c["format"], c.get("temperature", 1.0)): c
        for c in b["cells"]
        if c["mode"] == "aligned"
    }
    rows = []
    for name in b["planned"]:
        what, c = f"aligned bitwise {name.replace(':', ' ').replace(' 0.', ' T=0.')}", done.get(name, {})
        if "frac_bitwise_equal" not in c:
            rows.append((what, c.get("error", _why("alignment", ran))[:70], "frac 1.0", "no"))
            continue
        measured = f"frac {c['frac_bitwise_equal']:.4f} of {c['n_tokens']} tokens"
        if c.get("frac_same_experts") is not None:
            measured += f", same experts {c['frac_same_experts']:.4f}"
        rows.append((what, measured, "frac 1.0", _yes(c["frac_bitwise_equal"] == 1.0)))
    return rows


def _layout_rows(out_dir: pathlib.Path, ran: dict[str, str]) -> list[Row]:
    """The tensor-2 rollout's bitwise row (none on one device: the stage needs two)."""
    d = _load(out_dir, "layouts")
    what = "tensor-2 rollout == FSDP training (MoE w4a16)"
    if "skipped" in d:
        return []
    t = d.get("tensor2", {"error": _why("layouts", ran)})
    if "frac_bitwise_equal" not in t:
        return [(what, t.get("error", "")[:70], "frac 1.0", "no")]
    measured = f"frac {t['frac_bitwise_equal']:.4f} of {t['n_tokens']} tokens"
    measured += f", same experts {t['frac_same_experts']:.4f}"
    return [(what, measured, "frac 1.0", _yes(t["frac_bitwise_equal"] == 1.0))]


def _worst_kernel(k: dict, fmt: str, key: str) -> tuple[float | None, str]:
    """The smallest ``key`` of ``fmt`` over the rows with M <= 16, and where it was measured."""
    cells = [
        (r[fmt][key], shape)
        for shape, r in k.get("rows", {}).items()
        if int(shape.split("M=")[1]) <= 16 and fmt in r
    ]
    return min(cells) if cells else (None, "")


def _speed_rows(out_dir: pathlib.Path, ran: dict[str, str], judged: bool) -> list[Row]:
    rows = []
    if "kernel_speed" in ran:
        k = _load(out_dir, "kernel_speed")
        for fmt, key, target, what in (
            ("w4a16", "x_xla", 2.5, "w4a16 / XLA bf16 matmul, M<=16 (worst)"),
            ("w4a16", "TBps", 0.6 * PEAK_TBPS, "w4a16 weight TB/s, M<=16 (worst)"),
            ("w8a8", "x_xla", 1.6, "w8a8 / XLA bf16 matmul, M<=16 (worst)"),
        ):
            value, where = _worst_kernel(k, fmt, key)
            unit = "x" if key == "x_xla" else " TB/s"
            measured = _why("kernel_speed", ran) if value is None else f"{value:.2f}{unit} ({where})"
            rows.append((what, measured, f">= {target:.2f}{unit}", _judge(value, target, True, judged)))
    r, hf = _load(out_dir, "rollout"), _load(out_dir, "hf")
    bf16, w4 = r.get("bf16@16", {}).get("tokens_per_s"), r.get("w4a16@16", {}).get("tokens_per_s")
    if "rollout" in ran:
        ratio = w4 / bf16 if bf16 and w4 else None
        measured = _why("rollout", ran) if ratio is None else f"{ratio:.2f}x ({w4:.0f} / {bf16:.0f} tok/s)"
        rows.append(
            ("engine decode w4a16 / bf16, batch 16", measured, ">= 1.8x", _judge(ratio, 1.8, True, judged))
        )
    if "hf" in ran:
        ref = hf.get("hf@16", {}).get("tokens_per_s")
        ratio = bf16 / ref if bf16 and ref else None
        if "unavailable" in hf:
            measured = f"skipped: {hf['unavailable'][:70]}"
        elif ratio is None:
            measured = _why("hf" if ref is None else "rollout", ran)
        else:
            measured = f"{ratio:.2f}x ({bf16:.0f} / {ref:.0f} tok/s)"
        rows.append(
            ("engine bf16 / HF generate, batch 16", measured, ">= 2x", _judge(ratio, 2.0, True, judged))
        )
    if "train_step" in ran:
        t = _load(out_dir, "train_step")
        steps, ratio = t.get("steps", {}), t.get("w4a16_over_bf16")
        measured = _why("train_step", ran)
        if ratio is not None:
            measured = (
                f"{ratio:.2f}x ({steps['w4a16']['update_ms']:.1f} / {steps['bf16']['update_ms']:.1f} ms)"
            )
        rows.append(
            ("train step aligned w4a16 / bf16", measured, "<= 1.3x", _judge(ratio, 1.3, False, judged))
        )
    return rows


def _reported(out_dir: pathlib.Path) -> list[str]:
    d = _load(out_dir, "layouts")
    lines = [f"layouts: {d['skipped']}"] if "skipped" in d else []
    if "decode_ms" in d:
        ms = d["decode_ms"]
        lines.append(
            f"decode step on {d['devices']} devices: replicated {ms.get('replicated')} ms, FSDP layout "
            f"{ms.get('fsdp')} ms ({d.get('fsdp_over_replicated', '?')}x)"
        )
    return lines + _reported_stages(out_dir)


def _reported_stages(out_dir: pathlib.Path) -> list[str]:
    """What is reported without a target: naive mismatch, tokens/s per batch, shapes."""
    lines = []
    for c in _load(out_dir, "alignment").get("cells", []):
        if c["mode"] == "naive":
            got = (
                f"frac bitwise {c['frac_bitwise_equal']:.3g}, max |d| {c['max_abs_logp_diff']:.3g}"
                if "frac_bitwise_equal" in c
                else c.get("error", c.get("skipped", "?"))[:70]
            )
            lines.append(f"naive {c['model']} {c['format']}: {got}")
    r, hf = _load(out_dir, "rollout"), _load(out_dir, "hf")
    cells = {
        key: v["tokens_per_s"] for key, v in (*r.items(), *hf.items()) if "@" in key and isinstance(v, dict)
    }
    for batch in sorted({int(key.split("@")[1]) for key in cells}):
        got = [f"{f} {cells[f'{f}@{batch}']:.0f}" for f in (*FORMATS, "hf") if f"{f}@{batch}" in cells]
        lines.append(f"decode tokens/s at batch {batch}: " + ", ".join(got))
    skipped = r.get("skipped_over_budget", []) + hf.get("skipped_over_budget", [])
    if skipped:
        lines.append("decode cells not started (budget): " + ", ".join(skipped))
    t = _load(out_dir, "train_step")
    if t:
        lines.append(
            f"train step: {t['preset']} {t['overrides']}, {t['layers']} layers, batch {t['batch']} x "
            f"{t['length']}, {t['dtype']}, {t['device']}"
        )
    return lines


def summary(out_dir: pathlib.Path, mode: str, stages: pathlib.Path | None) -> int:
    """Print and write summary.txt for the stages that ran (all, without ``stages``); exit 1 when
    a correctness target is not met or has no evidence."""
    if stages is None:
        ran = dict.fromkeys(FILES, "?")
    else:
        fields = [line.split("\t") for line in stages.read_text().splitlines() if line]
        ran = {f[0]: f[1] for f in fields}
    correctness = (_kernel_rows(out_dir, ran) if "kernels" in ran else []) + (
        _alignment_rows(out_dir, ran) if "alignment" in ran else []
    )
    correctness += _layout_rows(out_dir, ran) if "layouts" in ran else []
    table = correctness + _speed_rows(out_dir, ran, judged=mode == "gpu")
    widths = [max(len(r[i]) for r in [HEADER, *table]) for i in range(3)]
    note = "" if mode == "gpu" else " (cpu: speed targets are the H200's and not judged here)"
    lines = [f"== device check summary, {mode}{note}"]
    for row in [HEADER, *table]:
        lines.append("  ".join(f"{c:<{w}}" for c, w in zip(row[:3], widths, strict=True)) + f"  {row[3]}")
    lines += ["== reported", *_reported(out_dir)]
    if stages is not None:
        lines.append("== stages: " + ", ".join(f"{f[0]} rc={f[1]} {f[2]}/{f[3]} s" for f in fields))
    text = "\n".join(lines)
    (out_dir / "summary.txt").write_text(text + "\n")
    print(text, flush=True)
    return 0 if all(r[3] == "yes" for r in correctness) else 1


def _cells(text: str) -> list[tuple[str, str, float]]:
    """``MODEL:FORMAT[:TEMPERATURE]`` items, comma-separated (temperature 1 by default)."""
    cells = []
    for item in text.split(","):
        parts = item.split(":")
        try:
            model, fmt, temperature = (*parts, "1")[:3] if len(parts) in (2, 3) else ("", "", "")
            cell = (model, fmt, float(temperature))
        except ValueError:
            cell = ("", "", 0.0)
        if cell[0] not in MODELS or cell[1] not in FORMATS or cell[2] <= 0:
            raise argparse.ArgumentTypeError(
                f"{item!r}: cells are MODEL:FORMAT[:TEMPERATURE] with MODEL in {MODELS}, FORMAT in {FORMATS}"
            )
        cells.append(cell)
    return cells


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=plain(__doc__.split("\n\n")[0]))
    sub = ap.add_subparsers(dest="stage", required=True)
    for name in ("kernels", "alignment", "layouts"):
        p = sub.add_parser(name)
        p.add_argument("--out", type=pathlib.Path, required=True)
        p.add_argument("--small", action="store_true", help="CPU-sized shapes (implied on CPU)")
    sub.choices["alignment"].add_argument(
        "--budget-s", type=float, default=60.0, help="no naive cell starts after this many seconds"
    )
    sub.choices["alignment"].add_argument(
        "--cells",
        type=_cells,
        default=[(m, f, 1.0) for m in MODELS for f in FORMATS] + [("qwen3-tiny", "w4a16", 0.7)],
        help="MODEL:FORMAT[:TEMPERATURE],...",
    )
    p = sub.add_parser("summary")
    p.add_argument("--dir", type=pathlib.Path, required=True)
    p.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    p.add_argument("--stages", type=pathlib.Path, help="tab-separated stage, rc, seconds, limit lines")
    args = ap.parse_args(argv)
    if args.stage == "summary":
        return summary(args.dir, args.mode, args.stages)
    sys.path.insert(0, str(ROOT))
    if args.stage == "kernels":
        return kernels(args.out, args.small)
    if args.stage == "layouts":
        return layouts(args.out, args.small)
    return alignment(args.out, args.small, args.budget_s, args.cells)


if __name__ == "__main__":
    sys.exit(main())
