"""What a compiled program moves between devices: the collectives of its optimized HLO.

Why from the optimized HLO: the SPMD partitioner decides the collectives (an FSDP weight gathered
whole before a matmul, a reduction finished with an all-reduce), and a program's source never shows
them. ``collective_bytes`` adds up the result bytes of every collective one device runs, per call of
the program: a collective inside a ``while`` body (a scanned layer, a loop over chunks) counts once
per iteration of XLA's ``known_trip_count`` (where XLA gives none, as for XLA:TPU's unrolled
``wide.*`` loops, read from the loop's counter: its start, step and bound); one in a computation a
loop or fusion calls counts as often as its caller. Result bytes: what an all-gather, all-to-all or
collective-permute delivers to the device and what an all-reduce or reduce-scatter hands back, a
lower bound on its traffic. Asynchronous pairs (``all-gather-start`` / ``-done``) count once, by the
``-done``'s result.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8\w*)\[([\d,]*)\]")
_CALLEES = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def array_bytes(shape: str) -> int:
    """Bytes of every array in an HLO result shape (a tuple's elements added up)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = 8 if dtype == "pred" or dtype.startswith("f8") else int(re.sub(r"\D", "", dtype))
        total += int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * bits // 8
    return total


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-done")
    return base if base in KINDS else None


@dataclasses.dataclass(frozen=True)
class Module:
    """An optimized HLO module's text, parsed: each computation's instructions as (name, result
    shape, opcode, the rest of the line), how often each computation runs per call of the entry
    (a loop body once per trip, a callee as often as its caller), and those under a loop of
    unknown trip count."""

    body: dict[str, list[tuple[str, str, str, str]]]
    runs: dict[str, int]
    under_unknown: set[str]


def parse(hlo_text: str, unknown_trips: int | None = None) -> Module:
    """The :class:`Module` of ``compiled.as_text()``; a loop whose trip count XLA does not know (the
    CPU row-block loops: theirs passes an optimization barrier) runs ``unknown_trips`` times, which
    the caller states (it knows its row blocks); without it, what runs under such a loop is marked."""
    body: dict[str, list[tuple[str, str, str, str]]] = defaultdict(list)
    named: dict[str, dict[str, tuple[str, str]]] = defaultdict(dict)  # computation -> name -> (opcode, rest)
    names: list[str] = []  # in print order: XLA prints a computation before any that calls it
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            names.append(current)
            entry = current if line.startswith("ENTRY") else entry
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            body[current].append((m.group(1), m.group(2), m.group(3), m.group(4)))
            named[current][m.group(1)] = (m.group(3), m.group(4))
    if entry is None:
        raise ValueError("not an HLO module's text: no ENTRY computation")
    runs: dict[str, int] = defaultdict(int)  # callers before callees
    runs[entry] = 1
    under_unknown: set[str] = set()  # computations run by a loop of unknown trip count
    for name in reversed(names):
        for _, _, opcode, rest in body[name]:
            times, unknown = runs[name], name in under_unknown
            if opcode == "while":
                known = _TRIPS.search(rest)
                trips = int(known.group(1)) if known else _counted_trips(named, name, rest)
                times *= trips if trips is not None else (unknown_trips or 1)
                unknown = unknown or (trips is None and unknown_trips is None)
            callees = _CALLEES.findall(rest)
            branches = _BRANCHES.search(rest)
            if branches:
                callees += [c.strip().lstrip("%") for c in branches.group(1).split(",")]
            for callee in callees:
                runs[callee] += times
                if unknown:
                    under_unknown.add(callee)
    return Module(dict(body), dict(runs), under_unknown)


def collective_bytes_by_kind(hlo_text: str, unknown_trips: int | None = None) -> dict[str, int]:
    """{collective kind: result bytes per device per call of the program} of an optimized HLO
    module's text (``compiled.as_text()``); kinds absent from it are absent. A collective under a
    loop of unknown trip count (see :func:`parse`) is an error rather than a wrong figure."""
    module = parse(hlo_text, unknown_trips)
    totals: dict[str, int] = defaultdict(int)
    for name, instructions in module.body.items():
        for _, shape, opcode, _ in instructions:
            kind = _kind(opcode)
            if kind is None:
                continue
            if name in module.under_unknown:
                raise ValueError(f"a {kind} in {name} runs in a loop of unknown trip count: cannot count it")
            totals[kind] += array_bytes(shape) * module.runs.get(name, 0)
    return dict(totals)


def _operands(rest: str) -> list[str]:
    """The instruction names an instruction's argument list starts with (before ``), attrs``)."""
    return re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])


def _source(instructions: dict[str, tuple[str, str]], name: str) -> tuple[str, str]:
    """(opcode, rest) of the instruction ``name`` copies (through any chain of copies)."""
    opcode, rest = instructions.get(name, ("", ""))
    while opcode == "copy":
        opcode, rest = instructions.get((_operands(rest) or [""])[0], ("", ""))
    return opcode, rest


def _constant(instructions: dict[str, tuple[str, str]], name: str) -> int | None:
    """The integer scalar constant ``name`` is (through copies), else None."""
    opcode, rest = _source(instructions, name)
    return int(rest.split(")", 1)[0]) if opcode == "constant" and re.match(r"-?\d+\)", rest) else None


def _counted_trips(named: dict[str, dict[str, tuple[str, str]]], caller: str, rest: str) -> int | None:
    """The trip count of a ``while`` that carries no ``known_trip_count`` (XLA:TPU's loops after
    its own unrolling, ``wide.*`` bodies, carry none), read from the loop itself: a condition
    ``counter < N``, a body that adds a constant step to the counter, and a constant initial
    value in the caller's operand tuple. None where the loop is not of that form."""
    cond, loop_body = re.search(r"condition=%?([\w.\-]+)", rest), re.search(r"body=%?([\w.\-]+)", rest)
    if not (cond and loop_body):
        return None
    compare = [r for op, r in named[cond.group(1)].values() if op == "compare" and "direction=LT" in r]
    if len(compare) != 1:
        return None
    counter, bound_name = (_operands(compare[0]) + [None, None])[:2]
    bound = _constant(named[cond.group(1)], bound_name or "")
    index = re.search(r"index=(\d+)", named[cond.group(1)].get(counter or "", ("", ""))[1])
    if bound is None or index is None:
        return None
    steps = set()
    for op, r in named[loop_body.group(1)].values():  # counter' = counter + step
        args = _operands(r)
        if op != "add" or len(args) != 2:
            continue
        gte = _source(named[loop_body.group(1)], args[0])
        if gte[0] == "get-tuple-element" and f"index={index.group(1)}" in gte[1]:
            step = _constant(named[loop_body.group(1)], args[1])
            steps.add(step)
    init_tuple = named[caller].get((_operands(rest) or [""])[0], ("", ""))
    inits = _operands(init_tuple[1]) if init_tuple[0] == "tuple" else []
    i = int(index.group(1))
    start = _constant(named[caller], inits[i]) if i < len(inits) else None
    if len(steps) != 1 or None in steps or start is None:
        return None
    (step,) = steps
    return max(0, -(-(bound - start) // step)) if step and step > 0 else None


def collective_bytes(hlo_text: str, unknown_trips: int | None = None) -> int:
    """Result bytes of all collectives one device runs per call (see the module doc); a loop of
    unknown trip count runs ``unknown_trips`` times (None: a collective under one is an error)."""
    return sum(collective_bytes_by_kind(hlo_text, unknown_trips).values())
