"""What runs quantized: :class:`QuantSpec` (the format, its int4 group size, which layer kinds, aligned
or naive) and the layer kinds a matmul belongs to.

Kinds: attention, mlp, experts (quantized by default), lm_head, router, embed (run the bf16-format
invariant kernel unless listed in ``QuantSpec.quantized``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from kernels_pallas.formats import WEIGHT_BITS, check_format, resolve_group_size

KINDS = ("attention", "mlp", "experts", "lm_head", "router", "embed")
MODES = ("aligned", "naive")
ATTENTION_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
MLP_MODULES = frozenset({"gate_proj", "up_proj", "down_proj"})


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    fmt: str = "bf16"  # bf16 | w8a8 | w4a16 | w4a8 | fp8
    group_size: int | None = None  # None: format default (128 for int4, per channel for w8a8 / fp8)
    quantized: tuple[str, ...] = ("attention", "mlp", "experts")  # the other kinds run the bf16 kernel
    # aligned: the training forward runs these kernels on weights quantized on the fly (QaRL);
    # naive: the rollout is quantized, the training forward is full precision (the paper's baseline)
    mode: str = "aligned"

    def __post_init__(self):
        check_format(self.fmt)
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {MODES}")
        unknown = [k for k in self.quantized if k not in KINDS]
        if unknown:
            raise ValueError(
                f"unknown layer kinds {unknown} in QuantSpec.quantized; expected some of {KINDS}"
            )

    def training_spec(self) -> QuantSpec | None:
        """The spec of the training forward: this one when aligned, None (plain XLA matmuls on the
        float master weights) when naive. The rollout always runs ``self``."""
        return self if self.mode == "aligned" else None

    def format_of(self, kind: str) -> tuple[str, int | None]:
        """(format, group size) that layers of ``kind`` run in."""
        if kind not in KINDS:
            raise ValueError(f"unknown layer kind {kind!r}; expected one of {KINDS}")
        if kind in self.quantized and self.fmt != "bf16":
            return self.fmt, self.group_size
        return "bf16", None

    def group_sizes(self, projections: Iterable[tuple[str, str, int]]) -> dict[str, int]:
        """The int4 group size each quantized projection of ``(kind, name, K)`` runs with (empty for
        the other formats): the format default is chosen per K (128, or a power of two that divides
        a K 128 does not). Raises ValueError in one line naming the first projection whose K the
        spec cannot take and what to set, before any weight is quantized."""
        sizes: dict[str, int] = {}
        for kind, name, k in projections:
            fmt, group_size = self.format_of(kind)
            if WEIGHT_BITS[fmt] is None:
                continue
            try:
                g = resolve_group_size(fmt, k, group_size)
            except ValueError as e:
                raise ValueError(
                    f"{name} ({kind} projection, K={k}) under quant.group_size={group_size}: {e}"
                ) from None
            if WEIGHT_BITS[fmt] == 4:
                sizes[name] = g
        return sizes
