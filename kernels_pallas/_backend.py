"""The one place a backend is chosen and its kernels are loaded.

Every operation is a package with one module per backend (``cpu``, ``gpu``: Pallas-Triton, ``tpu``:
Pallas Mosaic). A backend module is imported on its first call, so importing ``kernels_pallas``
never imports Pallas' Triton or Mosaic front ends, and a machine without one still runs the others.

A call's :class:`Target` (backend, Pallas interpreter or not, the caller's tiling overrides) is
hashable so custom VJPs can take it as a static argument.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable, Mapping
from types import ModuleType

import jax

BACKENDS = ("cpu", "gpu", "tpu")
Knob = int | bool | str


def resolve(backend: str | None) -> str:
    """``backend``, or the default JAX backend's name when None."""
    backend = jax.default_backend() if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    return backend


@functools.cache
def load(op: str, backend: str) -> ModuleType:
    """``kernels_pallas.<op>.<backend>``, imported on first use."""
    try:
        return importlib.import_module(f"kernels_pallas.{op}.{backend}")
    except ImportError as err:
        raise RuntimeError(
            f"no {backend} {op} kernels: kernels_pallas.{op}.{backend} does not import ({err}); "
            "pass backend='cpu' for the plain-JAX path"
        ) from err


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a call runs: the backend, Pallas' interpreter (accelerator kernels run on the CPU) or
    not, and the tiling knobs the caller set (each backend's kernels name their own)."""

    backend: str
    interpret: bool = False
    tiling: tuple[tuple[str, Knob], ...] = ()

    def kernel(self, op: str, name: str) -> Callable[..., jax.Array]:
        """The backend's ``name`` kernel of ``op`` with this target's interpreter flag and knobs."""
        fn = getattr(load(op, self.backend), name)
        knobs = dict(self.tiling)
        accepted = inspect.signature(fn).parameters
        unknown = sorted(set(knobs) - set(accepted))
        if unknown:
            offered = sorted(p.name for p in accepted.values() if p.kind is p.KEYWORD_ONLY)
            raise TypeError(
                f"the {self.backend} {op}.{name} kernel has no tiling knob {unknown[0]!r}; it takes {offered}"
            )
        if self.backend != "cpu":
            knobs["interpret"] = self.interpret
        return functools.partial(fn, **knobs)


def target(
    backend: str | None, interpret: bool = False, tiling: Mapping[str, Knob | None] | None = None
) -> Target:
    """The :class:`Target` of a public call; ``tiling`` entries that are None keep the defaults."""
    backend = resolve(backend)
    if interpret and backend == "cpu":
        raise ValueError(
            "interpret=True runs a Pallas kernel in its interpreter: pass backend='gpu' or 'tpu'"
        )
    knobs = tuple(sorted((k, v) for k, v in (tiling or {}).items() if v is not None))
    return Target(backend, bool(interpret), knobs)
