"""The one place a backend is chosen and its kernels are loaded.

Every operation is a package with one module per backend (``cpu``, ``gpu``: Pallas-Triton, ``tpu``:
Pallas Mosaic; ``xla``: XLA's own ops, fast but NOT batch-invariant, to measure what the invariance
costs). A backend module is imported on its first call, so importing ``kernels_pallas``
never imports Pallas' Triton or Mosaic front ends, and a machine without one still runs the others.

Every public function takes the same keyword :class:`Options` (backend, interpreter, tiling);
they resolve to a :class:`Target`, hashable so custom VJPs can take it as a static argument.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, TypedDict

import jax

BACKENDS = ("cpu", "gpu", "tpu", "xla")
_PALLAS = ("gpu", "tpu")
_DEFAULT: contextvars.ContextVar[str | None] = contextvars.ContextVar("kernels_pallas_backend", default=None)
_NOT_KNOBS = ("out_dtype", "interpret", "eps", "theta", "block_v", "block_kv")  # a kernel's other keywords
Knob = int | bool | str


class Options(TypedDict, total=False):
    """The keyword options of every public kernel function. Tiling knobs fix the program a row
    runs: pass the same ones to every call whose rows are compared. A knob the backend's kernel
    does not have is an error; None keeps the default.

    backend     "cpu" (plain JAX), "gpu" (Pallas-Triton), "tpu" (Pallas Mosaic) or "xla" (XLA's
                own ops, not invariant); None or absent: :func:`default_backend`'s, else
                ``jax.default_backend()``
    interpret   run the GPU/TPU kernel in Pallas' interpreter (on a CPU)
    block_rows  CPU: rows (attention: query tokens) per block
    block_m, block_n, block_k   GPU/TPU matmuls: rows, columns and K per tile / step
    num_warps, num_stages, split_k, swap_ab, int_dot, dequant   GPU matmuls (see ``_tiling.Blocks``);
                attention takes ``num_warps``
    """

    backend: str | None
    interpret: bool
    block_rows: int | None
    block_m: int | None
    block_n: int | None
    block_k: int | None
    num_warps: int | None
    num_stages: int | None
    split_k: int | None
    swap_ab: bool | None
    int_dot: str | None
    dequant: str | None


@contextlib.contextmanager
def default_backend(backend: str | None) -> Iterator[None]:
    """Within the block, calls that name no backend use ``backend`` (None: JAX's default). Read
    when a call is traced: a jitted function keeps the kernels it was first traced with. Used to
    run a whole model on the ``xla`` backend, e.g. to time what the invariant kernels cost."""
    if backend is not None:
        resolve(backend)
    token = _DEFAULT.set(backend)
    try:
        yield
    finally:
        _DEFAULT.reset(token)


def resolve(backend: str | None) -> str:
    """``backend``, or (when None) :func:`default_backend`'s, else the default JAX backend's name."""
    backend = backend or _DEFAULT.get() or jax.default_backend()
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
        params = inspect.signature(fn).parameters.values()
        accepted = [
            p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in ("out_dtype", "interpret")
        ]
        open_ended = any(p.kind is p.VAR_KEYWORD for p in params)  # the kernel checks its own knobs
        unknown = sorted(set(knobs) - set(accepted))
        if unknown and not open_ended:
            raise TypeError(
                f"the {self.backend} {op}.{name} kernel has no tiling knob {unknown[0]!r}; takes {accepted}"
            )
        if self.backend in _PALLAS:
            knobs["interpret"] = self.interpret
        return functools.partial(fn, **knobs)


def target(options: Options) -> Target:
    """The :class:`Target` of a public call's options."""
    given: dict[str, Any] = dict(options)
    unknown = sorted(set(given) - set(Options.__annotations__))
    if unknown:
        raise TypeError(f"unknown option {unknown[0]!r}; the options are {sorted(Options.__annotations__)}")
    backend = resolve(given.pop("backend", None))
    interpret = bool(given.pop("interpret", False))
    if interpret and backend not in _PALLAS:
        raise ValueError(
            "interpret=True runs a Pallas kernel in its interpreter: pass backend='gpu' or 'tpu'"
        )
    knobs = tuple(sorted((k, v) for k, v in given.items() if v is not None))
    return Target(backend, interpret, knobs)
