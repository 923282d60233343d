"""Which formats a GPU can run, by its compute capability, and which shapes its kernels tile: refused
in one line where the GPU kernels are chosen (and by ``qarl_jax.build`` before a checkpoint loads),
not deep in Triton's lowering.

fp8's Triton kernels widen float8_e4m3fn tiles to bf16, and Triton converts e4m3 only from
compute capability 8.9 (Ada, Hopper, Blackwell: JAX's Pallas-Triton lowering checks the same
bound); on an A100 (8.0) the kernel fails to compile with a message about Triton's types. No
workaround kernel here: the other formats run on those GPUs.

The check reads the GPU that Pallas-Triton lowers for (the host's first GPU); without a GPU (a CPU
host compiling for a GPU, or Pallas' interpreter) nothing is refused: Pallas then lowers for 9.0.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import jax

from kernels_pallas.formats import FORMATS, check_format

# format -> the lowest compute capability (major, minor) its GPU kernels compile for
MIN_CAPABILITY: dict[str, tuple[int, int]] = {"fp8": (8, 9)}


def _parse(capability: str) -> tuple[int, int]:
    major, _, minor = capability.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(f"compute capability must be 'major.minor' (e.g. '9.0'), got {capability!r}")
    return int(major), int(minor)


def unsupported(fmt: str, capability: str, device: str = "this GPU") -> str | None:
    """The one-line reason ``fmt``'s GPU kernels cannot run on a GPU of compute capability
    ``capability`` ('8.0', '9.0', '10.0'; compared as numbers), or None when they can. Pure: the
    check is tested without a GPU."""
    check_format(fmt)
    have, need = _parse(capability), MIN_CAPABILITY.get(fmt)
    if need is None or have >= need:
        return None
    runs = [f for f in FORMATS if MIN_CAPABILITY.get(f, (0, 0)) <= have]
    return (
        f"format {fmt!r} needs a GPU of compute capability {need[0]}.{need[1]} or newer (Ada, Hopper, "
        f"Blackwell: Triton converts float8_e4m3fn only there); {device} is {capability}: use one of "
        f"{', '.join(runs)}"
    )


def first_gpu() -> tuple[str, str] | None:
    """(compute capability, device kind) of the GPU Pallas-Triton lowers for (the host's first);
    None without a GPU, or on ROCm (it names architectures, e.g. gfx90a, and is not checked)."""
    try:
        device, *_ = jax.local_devices(backend="gpu")
    except RuntimeError:  # no GPU backend on this host
        return None
    capability = str(getattr(device, "compute_capability", ""))
    return (capability, device.device_kind) if re.fullmatch(r"\d+\.\d+", capability) else None


def check_gpu_format(fmt: str) -> None:
    """Raise ValueError with :func:`unsupported`'s line when this host's GPU (:func:`first_gpu`)
    cannot run ``fmt``'s Triton kernels; nothing on a host without one."""
    gpu = first_gpu() if fmt in MIN_CAPABILITY else None
    reason = None if gpu is None else unsupported(fmt, *gpu)
    if reason is not None:
        raise ValueError(reason)


# Triton's smallest dot dimension (kernels_pallas._triton.MIN_TILE, not imported: that module loads
# Pallas' Triton front end)
_MIN_TILE = 16


def _pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def unsupported_shape(head_dim: int, group_sizes: Iterable[int] = ()) -> str | None:
    """The one-line reason a model of ``head_dim`` whose int4 weights use ``group_sizes`` cannot run
    on the GPU kernels, or None: attention and RoPE hold a head in one power-of-two Triton block of
    at least 16 lanes, and the int4 matmul walks K in power-of-two groups of at least 32 rows (two
    16-row tiles). Pure: tested without a GPU."""
    if head_dim < _MIN_TILE or not _pow2(head_dim):
        need = f"a power-of-two head_dim >= {_MIN_TILE}"
        return f"the GPU attention and RoPE kernels need {need}, got {head_dim}"
    bad = sorted({g for g in group_sizes if g < 2 * _MIN_TILE or not _pow2(g)})
    if bad:
        return (
            f"the GPU int4 matmul needs power-of-two group sizes >= {2 * _MIN_TILE}; got {bad}: set "
            "quant.group_size to one that divides every K, or a per-channel format (w8a8, fp8)"
        )
    return None


def check_gpu_shapes(head_dim: int, group_sizes: Iterable[int] = ()) -> None:
    """Raise ValueError with :func:`unsupported_shape`'s line on a host with a GPU; nothing without."""
    reason = None if first_gpu() is None else unsupported_shape(head_dim, group_sizes)
    if reason is not None:
        raise ValueError(reason)
