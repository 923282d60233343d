"""Which formats a GPU can run, by its compute capability: refused in one line where the GPU kernels
are chosen (and by ``qarl_jax.run.build`` before a checkpoint loads), not deep in Triton's lowering.

fp8's Triton kernels widen float8_e4m3fn tiles to bf16, and Triton converts e4m3 only from
compute capability 8.9 (Ada, Hopper, Blackwell: JAX's Pallas-Triton lowering checks the same
bound); on an A100 (8.0) the kernel fails to compile with a message about Triton's types. No
workaround kernel here: the other formats run on those GPUs.

The check reads the GPU that Pallas-Triton lowers for (the host's first GPU); without a GPU (a CPU
host compiling for a GPU, or Pallas' interpreter) nothing is refused: Pallas then lowers for 9.0.
"""

from __future__ import annotations

import re

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
