"""What a compiled program moves between devices: the collectives of its optimized HLO.

Why from the optimized HLO: the SPMD partitioner decides the collectives (an FSDP weight gathered
whole before a matmul, a reduction finished with an all-reduce), and a program's source never shows
them. ``collective_bytes`` adds up the result bytes of every collective one device runs, per call
of the program: a collective inside a ``while`` body (a scanned layer, a loop over chunks) counts
once per iteration of XLA's ``known_trip_count``; one in a computation a loop or fusion calls counts
as often as its caller. Result bytes: what an all-gather, all-to-all or collective-permute delivers
to the device and what an all-reduce or reduce-scatter hands back, a lower bound on its traffic.
Asynchronous pairs (``all-gather-start`` / ``-done``) count once, by the ``-done``'s result.
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.+?) ([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8\w*)\[([\d,]*)\]")
_CALLEES = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _array_bytes(shape: str) -> int:
    """Bytes of every array in an HLO result shape (a tuple's elements added up)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = 8 if dtype == "pred" or dtype.startswith("f8") else int(re.sub(r"\D", "", dtype))
        total += int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * bits // 8
    return total


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-done")
    return base if base in KINDS else None


def collective_bytes_by_kind(hlo_text: str, unknown_trips: int | None = None) -> dict[str, int]:
    """{collective kind: result bytes per device per call of the program} of an optimized HLO
    module's text (``compiled.as_text()``); kinds absent from it are absent."""
    body: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
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
            body[current].append((m.group(1), m.group(2), m.group(3)))
    if entry is None:
        raise ValueError("not an HLO module's text: no ENTRY computation")
    # how often each computation runs per call of the entry, callers before callees; a loop whose
    # trip count XLA does not know (the CPU row-block loops: theirs passes an optimization barrier)
    # runs ``unknown_trips`` times, which the caller states (it knows its row blocks); without it a
    # collective under such a loop is an error rather than a wrong figure
    runs: dict[str, int] = defaultdict(int)
    runs[entry] = 1
    under_unknown: set[str] = set()  # computations run by a loop of unknown trip count
    for name in reversed(names):
        for _, opcode, rest in body[name]:
            times, unknown = runs[name], name in under_unknown
            if opcode == "while":
                trips = _TRIPS.search(rest)
                times *= int(trips.group(1)) if trips else (unknown_trips or 1)
                unknown = unknown or (trips is None and unknown_trips is None)
            callees = _CALLEES.findall(rest)
            branches = _BRANCHES.search(rest)
            if branches:
                callees += [c.strip().lstrip("%") for c in branches.group(1).split(",")]
            for callee in callees:
                runs[callee] += times
                if unknown:
                    under_unknown.add(callee)
    totals: dict[str, int] = defaultdict(int)
    for name, instructions in body.items():
        for shape, opcode, _ in instructions:
            kind = _kind(opcode)
            if kind is None:
                continue
            if name in under_unknown:
                raise ValueError(f"a {kind} in {name} runs in a loop of unknown trip count: cannot count it")
            totals[kind] += _array_bytes(shape) * runs[name]
    return dict(totals)


def collective_bytes(hlo_text: str, unknown_trips: int | None = None) -> int:
    """Result bytes of all collectives one device runs per call (see the module doc); a loop of
    unknown trip count runs ``unknown_trips`` times (None: a collective under one is an error)."""
    return sum(collective_bytes_by_kind(hlo_text, unknown_trips).values())
