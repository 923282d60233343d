"""The experts the rollout engine routed every token to, for MoE alignment checks.

The MoE layers ``sow`` their top-k choices (``router_topk``) into "intermediates" (a no-op unless
that collection is mutable). :class:`RouteRecorder` is the engine's decode hook
(:class:`~qarl_jax.rollout.engine.DecodeHook`): inside the jitted prefill and generate calls it
keeps those choices, and on the host it files them by sample with the slot -> sample assignment
the driver makes at insert. The token bits are the plain engine's: the same decode forward runs,
its routing is only returned as well.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qarl_jax.rollout.engine import SlotRequest, StepOutput

SampleId = tuple[int, int]  # (prompt index, sample index)


def routed_experts(intermediates) -> jax.Array | None:
    """[B, T, MoE layers, top_k] expert indices from a forward's "intermediates" collection, in
    layer order; None when the model has no MoE layer. Per-layer modules (``layers_{i}``) sow
    [B, T, top_k]; a scanned run (``stack_{start}_{stop}``) sows its layers stacked in front."""
    found = []
    for name, tree in intermediates.items():
        if "router_topk" not in tree.get("mlp", {}):
            continue
        topk = tree["mlp"]["router_topk"][0]
        if name.startswith("layers_"):
            found.append((int(name.removeprefix("layers_")), topk[:, :, None]))
        elif name.startswith("stack_"):
            found.append((int(name.split("_")[1]), jnp.moveaxis(topk, 0, 2)))
    return jnp.concatenate([t for _, t in sorted(found, key=lambda f: f[0])], axis=2) if found else None


class RouteRecorder:
    """Records, for every token the engine's decode forward processes, the experts it was routed
    to (read back once, by :meth:`routes`). Pass it as ``RolloutEngine(..., hook=recorder)``."""

    def __init__(self) -> None:
        self._prompts: Sequence[Sequence[int]] = ()
        self._prefill_routes: jax.Array | None = None
        self._slot_sample: dict[int, SampleId] = {}
        self._prefill_rows: list[tuple[SampleId, int, int, jax.Array | None]] = []  # id, row, plen, routes
        self._steps: list[tuple[dict[int, SampleId], jax.Array, jax.Array, jax.Array | None]] = []

    def collect(self, positions: jax.Array, intermediates: dict) -> tuple[jax.Array, jax.Array | None]:
        return positions, routed_experts(intermediates)

    def prefilled(self, prompts: Sequence[Sequence[int]], collected) -> None:
        self._prompts, (_, self._prefill_routes) = prompts, collected

    def inserted(self, requests: Sequence[SlotRequest]) -> None:
        for r in requests:
            sid = (r.prompt_index, r.sample_index)
            self._slot_sample[r.slot] = sid
            self._prefill_rows.append((sid, r.row, len(self._prompts[r.row]), self._prefill_routes))

    def generated(self, out: StepOutput, collected) -> None:
        positions, routes = collected
        self._steps.append((dict(self._slot_sample), positions, out.valid, routes))

    def routes(self, lengths: dict[SampleId, int]) -> dict[SampleId, np.ndarray]:
        """Per sample, [lengths[id], MoE layers, top_k]: the experts of the tokens at positions
        0..lengths[id]-1 (every token the decode forward processed: the prompt and all generated
        tokens but the last)."""
        first = self._prefill_rows[0][3] if self._prefill_rows else None
        if first is None:
            raise RuntimeError("no routing recorded: the model has no MoE layer or nothing was rolled out")
        out = {sid: np.full((n, *first.shape[2:]), -1, np.int32) for sid, n in lengths.items()}
        for sid, row, plen, routes in jax.device_get(self._prefill_rows):
            if sid in out:
                out[sid][:plen] = routes[row, :plen]
        for slot_sample, positions, valid, routes in jax.device_get(self._steps):
            for slot in np.flatnonzero(valid):
                sid = slot_sample.get(int(slot))
                if sid in out:
                    out[sid][positions[slot, 0]] = routes[slot, 0]
        missing = [sid for sid, r in out.items() if (r < 0).any()]
        if missing:
            raise RuntimeError(f"routing of samples {missing[:5]} was not fully recorded")
        return out
