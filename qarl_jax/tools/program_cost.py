"""What a compiled program costs one chip per call, read from its optimized HLO, and the floor in
seconds that follows from a chip's published figures.

Why not ``compiled.cost_analysis()``: XLA counts a ``while`` body once, whatever its trip count, so
a scanned layer stack (and a loop over micro-batch chunks) counts as one layer (checked: a scan of
10 matmuls reports the FLOPs of one). Here every instruction counts as often as its computation runs
(:func:`qarl_jax.tools.collectives.parse`: loop trips and callers).

The model, per instruction of a computation that runs (not inside a fusion: a fusion's body stays
on chip):

  hbm_bytes   a fusion, copy, dot, convolution, sort, scatter, gather or custom call reads its
              operands from HBM and writes its result: their bytes, except that an operand a fusion
              only slices (``dynamic-slice``, ``slice``: a layer out of the stacked weights) counts
              the slices, and a fusion whose root updates an operand in place
              (``dynamic-update-slice``: the KV cache) counts the update, not the whole buffer. A
              Mosaic kernel (``tpu_custom_call``) counts its ``pl.CostEstimate``'s bytes, also
              where XLA fused its operands' producers into it (a layer sliced out of a stack).
  flops       2 x the products of every ``dot`` and ``convolution`` (in fusions too), and a Mosaic
              kernel's estimate; elementwise work (the VPU's) is left out: the floor is the MXU's.

Collectives are :mod:`qarl_jax.tools.collectives`' (result bytes at the ICI bandwidth).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator

from qarl_jax.tools.collectives import array_bytes, parse

_COUNTED = {"fusion", "copy", "dot", "convolution", "sort", "scatter", "gather", "custom-call", "reduce"}
_SHAPE = re.compile(r"\b[a-z]\w*\[([\d,]*)\]")
_SLICES = ("dynamic-slice", "slice")


@dataclasses.dataclass(frozen=True)
class Chip:
    """One chip's published figures (Cloud TPU documentation, system architecture tables)."""

    hbm_bytes_s: float  # HBM bandwidth
    bf16_flops_s: float  # peak MXU, bf16
    int8_ops_s: float  # peak MXU, int8
    ici_bytes_s: float  # inter-chip interconnect, per chip
    source: str


# cloud.google.com/tpu/docs/{v5e,v5p,v6e}: HBM GB/s, bf16 TFLOP/s, int8 TOP/s, ICI Gbit/s
CHIPS = {
    "v5e": Chip(819e9, 197e12, 393e12, 1600e9 / 8, "cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip(2765e9, 459e12, 918e12, 4800e9 / 8, "cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip(1640e9, 918e12, 1836e12, 3584e9 / 8, "cloud.google.com/tpu/docs/v6e"),
}


@dataclasses.dataclass(frozen=True)
class Cost:
    """HBM bytes and MXU FLOPs one chip spends per call of a program."""

    hbm_bytes: int
    flops: int


def _dims(shape: str) -> list[int]:
    m = _SHAPE.search(shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _operands(rest: str) -> list[str]:
    return re.findall(r"%([\w.\-]+)", rest.split("), ", 1)[0])


def _dot_flops(shape: str, opcode: str, rest: str, shapes: dict[str, str]) -> int:
    """2 x the multiply-adds of a dot or convolution (result elements x contracted extent)."""
    out = math.prod(_dims(shape))
    args = _operands(rest)
    if opcode == "dot":
        lhs = _dims(shapes.get(args[0], "")) if args else []
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        k = math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i) if contracting and lhs else 1
        return 2 * out * k
    kernel = _dims(shapes.get(args[1], "")) if len(args) > 1 else []
    labels = re.search(r"dim_labels=\w+_(\w+)->", rest)
    if not kernel or not labels or "o" not in labels.group(1):
        return 2 * out
    return 2 * out * math.prod(kernel) // kernel[labels.group(1).index("o")]


_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # op -> its update operand


def _use(body, name: str | None, bodies) -> tuple[int, int] | None:
    """(bytes read, bytes written in place) of a fusion body's value ``name`` where the body only
    slices it (``dynamic-slice``, ``slice``) or updates it in place (``dynamic-update-slice``,
    ``scatter``: the KV cache), directly or through a bitcast, a relayout (a copy, or a nested
    fusion that only copies: per element in a fusion) or a nested fusion; None where some use
    reads it whole."""
    read = written = 0
    used = False
    for n, s, opcode, r in body:
        args = _operands(r)
        if name not in args:
            continue
        used = True
        nested = re.search(r"calls=%?([\w.\-]+)", r) if opcode == "fusion" else None
        if opcode in _SLICES + ("gather",) and args[0] == name:  # a gather reads its result's rows
            read += array_bytes(s)
        elif opcode in _IN_PLACE and args[0] == name and args.count(name) == 1:
            update = args[_IN_PLACE[opcode]] if len(args) > _IN_PLACE[opcode] else ""
            written += next((array_bytes(x) for m, x, _, _ in body if m == update), 0)
        elif opcode in ("bitcast", "copy") or (nested and _relayout(bodies.get(nested.group(1), []))):
            # a relayout in a fused body is per element: what reads its result reads these elements
            inner = _use(body, n, bodies)
            if inner is None:
                return None
            read, written = read + inner[0], written + inner[1]
        elif nested and args.count(name) == 1:
            fused = bodies.get(nested.group(1), [])
            param = next(
                (m for m, _, op, x in fused if op == "parameter" and x.startswith(f"{args.index(name)})")),
                None,
            )
            inner = _use(fused, param, bodies)
            if inner is None:
                return None
            read, written = read + inner[0], written + inner[1]
        else:
            return None
    return (read, written) if used else None


def _relayout(fused) -> bool:
    """A nested fusion that only copies its one operand into another tiling (XLA:TPU's
    ``copy_fusion`` of a whole stacked weight ahead of a layer's ``dynamic-slice``)."""
    ops = [op for _, _, op, _ in fused]
    return ops.count("parameter") == 1 and set(ops) <= {"parameter", "copy", "bitcast"}


def _fusion_bytes(shape: str, operand_shapes: list[str], fused, bodies) -> int:
    """Bytes a fusion moves: each operand whole unless the fused body only slices it or updates it
    in place (then the slices, and the updates read and written), and its result, less any buffer
    updated in place (which the result holds: aliased, not rewritten)."""
    params = {int(r.split(")")[0]): n for n, _, op, r in fused if op == "parameter"}
    total, in_place = 0, 0
    for i, operand in enumerate(operand_shapes):
        use = _use(fused, params.get(i), bodies)
        if use is None:
            total += array_bytes(operand)
            continue
        total += use[0] + 2 * use[1]
        in_place += array_bytes(operand) if use[1] else 0
    return total + max(0, array_bytes(shape) - in_place)


def program_cost(hlo_text: str, unknown_trips: int | None = None) -> Cost:
    """The :class:`Cost` of one call of a compiled program (see the module doc)."""
    module = parse(hlo_text, unknown_trips)
    shapes = {name: s for instrs in module.body.values() for name, s, _, _ in instrs}
    fusion_of = re.compile(r"calls=%?([\w.\-]+)")
    fusions = {
        m.group(1)
        for instrs in module.body.values()
        for _, _, op, r in instrs
        if op == "fusion"
        for m in [fusion_of.search(r)]
        if m
    }
    estimates = _estimates(hlo_text)
    hbm = flops = 0
    for comp, instrs in module.body.items():
        runs = module.runs.get(comp, 0)
        for name, shape, opcode, rest in instrs:
            if opcode in ("dot", "convolution"):  # wherever it is, fused or not
                flops += _dot_flops(shape, opcode, rest, shapes) * runs
            if not runs or comp in fusions or opcode not in _COUNTED:
                continue
            operand_shapes = [shapes.get(a, "") for a in _operands(rest)]
            fused = fusion_of.search(rest) if opcode == "fusion" else None
            kernel = name if opcode == "custom-call" else _fused_kernel(module.body, fused)
            if kernel in estimates:
                estimate = estimates[kernel]
                hbm, flops = hbm + estimate.hbm_bytes * runs, flops + estimate.flops * runs
                continue
            if fused:
                moved = _fusion_bytes(shape, operand_shapes, module.body.get(fused.group(1), []), module.body)
            elif opcode == "gather":  # the rows it picks (its result), the indices, the result
                moved = 2 * array_bytes(shape) + sum(array_bytes(s) for s in operand_shapes[1:])
            else:
                moved = sum(array_bytes(s) for s in operand_shapes) + array_bytes(shape)
            hbm += moved * runs
    return Cost(hbm, flops)


def _fused_kernel(bodies, fused: re.Match | None) -> str | None:
    """The name of the Mosaic kernel call a ``kCustom`` fusion wraps (XLA fused an operand's
    producer, a layer's slice of a stack, into the kernel's reads: ``allow_input_fusion``), or None."""
    body = bodies.get(fused.group(1), []) if fused else []
    return next((n for n, _, op, r in body if op == "custom-call" and "tpu_custom_call" in r), None)


_KERNEL_CALL = re.compile(r'%([\w.\-]+) = [^\n]*custom_call_target="tpu_custom_call"')


def mosaic_calls(hlo_text: str) -> Iterator[tuple[str, str, dict | None]]:
    """Each Mosaic kernel call of a compiled TPU program's HLO text, in order: its instruction name,
    its first line, and its backend config (None where it has none). Read from the whole text: a
    kernel's cost estimate can put a line break inside its config, and attributes may follow it."""
    decoder = json.JSONDecoder()
    for call in _KERNEL_CALL.finditer(hlo_text):
        line = hlo_text[call.start() :].split("\n", 1)[0]
        at = hlo_text.find("backend_config=", call.end())
        between = hlo_text[call.end() : at]
        if at < 0 or "\n  %" in between or "\n  ROOT " in between:  # none before the next instruction
            yield call.group(1), line, None
            continue
        config = decoder.raw_decode(hlo_text, at + len("backend_config="))[0]
        yield call.group(1), line, json.loads(config) if isinstance(config, str) else config  # quoted


def _estimates(hlo_text: str) -> dict[str, Cost]:
    """Each Mosaic kernel call's ``pl.CostEstimate``, by instruction name; zero where it has none."""
    found = {}
    for name, _, config in mosaic_calls(hlo_text):
        estimate = (config or {}).get("custom_call_config", {}).get("cost_estimate", {})
        found[name] = Cost(int(estimate.get("bytes_accessed", 0)), int(estimate.get("flops", 0)))
    return found


def floor(chip: Chip, cost: Cost, collective_bytes: int, int8: bool) -> dict[str, float | str]:
    """Seconds one call cannot beat on ``chip``: the largest of its HBM traffic at the HBM
    bandwidth, its FLOPs at the MXU peak (int8's for the a8 formats' programs) and its collective
    bytes at the ICI bandwidth (all three can overlap, so the largest, not the sum), and which."""
    parts = dict(
        hbm=cost.hbm_bytes / chip.hbm_bytes_s,
        mxu=cost.flops / (chip.int8_ops_s if int8 else chip.bf16_flops_s),
        ici=collective_bytes / chip.ici_bytes_s,
    )
    bound = max(parts, key=lambda k: parts[k])
    return dict(seconds_floor=parts[bound], bound=bound, **{f"{k}_s": v for k, v in parts.items()})


def rl_step_floor(
    floors: dict[str, float], calls: dict[str, int], sync_bytes: int, chip: Chip
) -> dict[str, float | dict[str, float]]:
    """An RL step's floor in seconds on one chip: each program's floor times the calls a step makes
    of it (``calls``: decode steps, prefills, one old-log-prob pass, the minibatches' updates; the
    programs run one after another), plus the weight sync, ``sync_bytes`` (the new frozen weights a
    chip receives) at the ICI bandwidth; and where it goes (seconds by part)."""
    parts = {name: floors[name] * n for name, n in calls.items()}
    parts["weight_sync"] = sync_bytes / chip.ici_bytes_s
    return dict(seconds_floor=sum(parts.values()), parts=parts)


INT8_FORMATS = ("w8a8", "w4a8")  # int8 x int8 MXU dots; fp8 widens e4m3 to bf16 on TPU


def floors(
    programs: dict[str, tuple[Cost, int]], calls: dict[str, int], sync_bytes: int, generation: str, fmt: str
) -> dict | None:
    """Per program ``{hbm_bytes, flops, seconds_floor, bound, hbm_s, mxu_s, ici_s}`` (``programs``:
    name -> (cost, collective bytes)) and the RL step's floor, on a chip of ``generation``; None for
    a generation without published figures here."""
    chip = CHIPS.get(generation)
    if chip is None:
        return None
    per = {
        name: dict(hbm_bytes=cost.hbm_bytes, flops=cost.flops)
        | floor(chip, cost, collective, fmt in INT8_FORMATS)
        for name, (cost, collective) in programs.items()
    }
    step = rl_step_floor({n: float(v["seconds_floor"]) for n, v in per.items()}, calls, sync_bytes, chip)
    chip_figures = dataclasses.asdict(chip) | dict(name=generation)
    return dict(programs=per, rl_step=step | dict(calls=calls), chip=chip_figures)


def format_floors(floors: dict) -> list[str]:
    """:func:`floors` as lines: per program its HBM GB, TFLOPs and floor; the RL step's by part."""
    chip, step = floors["chip"], floors["rl_step"]
    lines = [f"  floors on a {chip['name']} chip (published figures, {chip['source']}; floors, not timings):"]
    for name, x in floors["programs"].items():
        lines.append(
            f"  {name:<14}{x['hbm_bytes'] / 1e9:>10.2f} GB HBM {x['flops'] / 1e12:>9.3f} TFLOP"
            f"  floor {x['seconds_floor'] * 1e3:>10.3f} ms ({x['bound']})"
        )
    parts = ", ".join(f"{k} {v:.4g} s ({step['calls'].get(k, 1)}x)" for k, v in step["parts"].items())
    return lines + [f"  RL step floor {step['seconds_floor']:.4g} s: {parts}"]
