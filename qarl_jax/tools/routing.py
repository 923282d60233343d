"""The experts the rollout engine routed every token to, for MoE alignment checks.

The MoE layers ``sow`` their top-k choices (``router_topk``) into "intermediates" (a no-op unless
that collection is mutable). :class:`RoutingEngine` re-jits the engine's prefill and generate
calls so they also return those choices, and its host wrappers file them by sample with the
slot -> sample assignment the driver makes at insert. The token bits are the plain engine's: the same decode
forward runs, its routing is only returned as well.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qarl_jax.rollout.engine import DecodeState, Prefix, RolloutEngine, SlotRequest, StepOutput

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


class RoutingEngine(RolloutEngine):
    """A :class:`RolloutEngine` that also records, for every token its decode forward processes,
    the experts it was routed to (read back once, by :meth:`routes`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._prefill = jax.jit(self._with_routes(self._prefill_impl))
        self._generate = jax.jit(self._with_routes(self.generate_impl), donate_argnums=(1,))
        self._traced: tuple[jax.Array, jax.Array] | None = None
        self._prefilled: tuple[Sequence[Sequence[int]], tuple[jax.Array, jax.Array]] | None = None
        self._slot_sample: dict[int, SampleId] = {}
        self._prefill_rows: list[tuple[SampleId, int, int, jax.Array]] = []  # id, row, prompt len, routes
        self._steps: list[tuple[dict[int, SampleId], jax.Array, jax.Array, jax.Array]] = []

    def _apply_decode(self, params, tokens, positions, cache):
        return self._routed(params, tokens, positions, cache, "decode")

    def _apply_decode_hidden(self, params, tokens, positions, cache):
        return self._routed(params, tokens, positions, cache, "decode_hidden")

    def _prefill_chunk(self, t: int) -> int:
        """Whole prompts: the routes are read back from the one traced call (the bits do not depend
        on the chunking)."""
        return t

    def _routed(self, params, tokens, positions, cache, method: str):
        out, state = self.model.apply(
            {"params": params}, tokens, positions, cache, method=method, mutable=["intermediates"]
        )
        # read back by _with_routes within the same trace
        self._traced = (positions, routed_experts(state["intermediates"]))
        return out

    def _with_routes(self, fn: Callable) -> Callable:
        def call(*args):
            out = fn(*args)
            traced, self._traced = self._traced, None
            return out, traced

        return call

    def prefill(self, params, prompts: Sequence[Sequence[int]]) -> Prefix:
        prefix, traced = super().prefill(params, prompts)
        self._prefilled = (prompts, traced)
        return prefix

    def insert(self, prefix: Prefix, state: DecodeState, requests: Sequence[SlotRequest], seed: int):
        prompts, (_, routes) = self._prefilled
        for r in requests:
            self._slot_sample[r.slot] = (r.prompt_index, r.sample_index)
            self._prefill_rows.append(((r.prompt_index, r.sample_index), r.row, len(prompts[r.row]), routes))
        return super().insert(prefix, state, requests, seed)

    def generate(self, params, state: DecodeState) -> tuple[DecodeState, StepOutput]:
        (state, out), (positions, routes) = super().generate(params, state)
        self._steps.append((dict(self._slot_sample), positions, out.valid, routes))
        return state, out

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
