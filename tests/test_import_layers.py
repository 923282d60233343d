"""The packages' floors, read from the source (AST, nothing imported): no import up a floor, lazy ones
included, and no circle among the imports a module runs when it loads.

Floors, lowest first: the kernels (``kernels_pallas``, which imports nothing of ``qarl_jax``); the
base modules every floor uses (errors, sharding, cli, ...); quant; models; data and rewards; rollout;
rl; the run's lifecycle (config, build, train, checkpoint, ...); the entry points (main, serve, sft,
evaluate, tools, experiments). A module may import its own floor or below. ``python -m pytest
tests/test_import_layers.py -q`` prints the offending edges when it fails."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("kernels_pallas", "qarl_jax")
BASE = ("errors", "sharding", "quiet_import", "cli", "storage")
LIFECYCLE = ("config", "run")  # qarl_jax/run/: the run's lifecycle
ENTRY = ("main", "serve", "sft", "evaluate", "tools", "experiments")
FLOORS = [("quant",), ("models",), ("data", "rewards"), ("rollout",), ("rl",), LIFECYCLE, ENTRY]


def floor(module: str) -> int | None:
    """The floor of a dotted module name (0 the kernels, 1 the base, then :data:`FLOORS`); None for
    a module given none (a new top-level module must be placed)."""
    if module.split(".")[0] == "kernels_pallas":
        return 0
    part = module.split(".")[1] if "." in module else ""
    if part in ("", *BASE):
        return 1
    return next((2 + i for i, names in enumerate(FLOORS) if part in names), None)


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if "tests" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(path: pathlib.Path, known: set[str]) -> list[tuple[str, bool]]:
    """(imported module, whether it runs when the importing module loads) for every import of a
    module in ``known``: ``from pkg import name`` is ``pkg.name`` when that is a module, else ``pkg``;
    imports inside functions and ``if TYPE_CHECKING`` blocks do not run at load."""
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, at_load: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for alias in child.names:
                    name = f"{child.module}.{alias.name}"
                    target = name if name in known else child.module
                    if target in known:
                        out.append((target, at_load))
            elif isinstance(child, ast.Import):
                out.extend((a.name, at_load) for a in child.names if a.name in known)
            lazy = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            visit(child, at_load and not lazy and not _type_checking(child))

    visit(ast.parse(path.read_text()), True)
    return out


def graph() -> tuple[dict[str, list[tuple[str, bool]]], dict[str, pathlib.Path]]:
    mods = modules()
    return {m: [(t, load) for t, load in imports(p, set(mods)) if t != m] for m, p in mods.items()}, mods


def test_every_module_has_a_floor():
    _, mods = graph()
    assert not [m for m in mods if floor(m) is None]


def test_no_import_up_a_floor():
    edges, _ = graph()
    level = lambda m: -1 if floor(m) is None else floor(m)  # noqa: E731
    up = sorted(f"{m} -> {t}" for m, ts in edges.items() for t, _ in ts if level(t) > level(m))
    assert not up, "imports up a floor:\n" + "\n".join(up)


def test_no_circle_among_load_time_imports():
    """Tarjan's strongly connected components over the imports that run at load; a package's own
    ``__init__`` re-exporting its modules is not a circle when the module imports a sibling, not
    the package."""
    edges, mods = graph()
    load = {m: sorted({t for t, at_load in edges[m] if at_load}) for m in mods}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in load[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(mods):
        if v not in index:
            connect(v)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)
