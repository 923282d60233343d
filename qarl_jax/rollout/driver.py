"""Batch rollout for RL: prompts x n samples through the engine with continuous batching.

The host dispatches ``sync_every`` generate steps without waiting (the device finishes samples on
EOS / max tokens by itself), then reads the small per-step outputs once, records tokens, applies
stop strings, and refills every freed slot before the next window. Results do not depend on slot
assignment or timing: each sample's key is (seed, prompt index, sample index).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np
from tqdm import tqdm

from qarl_jax.rollout.engine import RolloutEngine, SlotRequest, StepOutput
from qarl_jax.rollout.sampling import SamplingParams


@dataclasses.dataclass
class Sample:
    """One completion. ``logprobs``: policy at temperature 1, untruncated (what RL needs);
    ``sampling_logprobs``: under the distribution the token was drawn from, described by
    ``sampling`` ("policy": identical to ``logprobs``; "greedy": all 0)."""

    prompt_index: int
    sample_index: int
    tokens: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float]
    sampling: str
    finish_reason: str | None = None  # "eos" | "stop_string" | "length"

    @property
    def length(self) -> int:
        return len(self.tokens)


def _stop_cut(sample: Sample, stop_strings: Sequence[str], tokenizer, checked: int) -> int | None:
    """Number of tokens up to and including the one completing a stop string, or None.

    Only the tail is decoded: a stop string completed after token ``checked`` lies within its
    length in bytes of tokens before it (a token holds at least one byte), so decoding from a few
    more tokens back finds it, and a response costs O(length) decoding, not O(length^2) (16k-token
    responses)."""
    start = max(0, checked - max(len(s.encode()) for s in stop_strings) - 8)
    if not any(s in tokenizer.decode(sample.tokens[start:]) for s in stop_strings):
        return None
    for j in range(checked + 1, sample.length + 1):
        text = tokenizer.decode(sample.tokens[start:j])
        if any(s in text for s in stop_strings):
            return j
    return None


def rollout(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    n: int = 1,
    max_new_tokens: int = 256,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    stop_strings: Sequence[str] = (),
    tokenizer=None,
    ignore_eos: bool = False,
    prompt_ids: Sequence[int] | None = None,
    sync_every: int = 4,
    progress: bool = True,
) -> list[list[Sample]]:
    """Generate ``n`` samples for every prompt (token ids); returns samples[prompt][sample].

    Stop strings need ``tokenizer`` (anything with ``decode(ids) -> str``); the token completing a
    stop string is kept, later ones are dropped. A stopping EOS token is kept (its log-prob counts).
    ``prompt_ids`` (default 0..P-1) name the prompts in the sample keys: give dataset indices to
    make a prompt's samples the same whichever batch it is drawn in."""
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode with")
    if n < 1 or max_new_tokens < 1 or sync_every < 1:
        raise ValueError("n, max_new_tokens and sync_every must be >= 1")
    sampling = sampling or SamplingParams()
    prompt_ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
    if len(prompt_ids) != len(prompts):
        raise ValueError(f"{len(prompt_ids)} prompt_ids for {len(prompts)} prompts")
    c = engine.config
    too_long = [i for i, p in enumerate(prompts) if not 0 < len(p) <= c.max_prompt_len]
    if too_long:
        raise ValueError(f"prompts {too_long[:5]} are empty or longer than {c.max_prompt_len} tokens")
    state = engine.allocate()
    engine.state = None  # donated below; put back at the end
    out: dict[tuple[int, int], Sample] = {}  # (prompt, sample) -> finished sample
    work = collections.deque((p, s) for p in range(len(prompts)) for s in range(n))
    in_slot: list[Sample | None] = [None] * c.slots
    checked = [0] * c.slots
    bar = tqdm(total=len(prompts) * n, unit="sample", desc="rollout", disable=not progress, leave=False)
    start, emitted = time.perf_counter(), 0

    def finish(slot: int, reason: str | None = None) -> None:
        """Apply stop strings to the slot's new tokens; end the sample on a hit or on ``reason``."""
        sample = in_slot[slot]
        assert sample is not None, "only a slot holding a sample is finished"
        cut = _stop_cut(sample, stop_strings, tokenizer, checked[slot]) if stop_strings else None
        checked[slot] = sample.length
        if cut is not None:
            for field in ("tokens", "logprobs", "sampling_logprobs"):
                del getattr(sample, field)[cut:]
            reason = "stop_string"
        if reason is None:
            return
        sample.finish_reason = reason
        out[(sample.prompt_index, sample.sample_index)] = sample
        in_slot[slot] = None
        bar.update(1)

    while work or any(s is not None for s in in_slot):
        free = [i for i, s in enumerate(in_slot) if s is None]
        inserts: list[tuple[list[int], StepOutput]] = []
        while free and work:
            batch = _next_requests(work, len(free), c.max_prefill_batch)
            unique = list(dict.fromkeys(p for p, _ in batch))
            prefix = engine.prefill(engine.params, [prompts[p] for p in unique])
            requests = []
            for p, s in batch:
                slot = free.pop(0)
                requests.append(
                    SlotRequest(
                        row=unique.index(p),
                        slot=slot,
                        prompt_index=prompt_ids[p],
                        sample_index=s,
                        max_new=max_new_tokens,
                        sampling=sampling,
                        stop_on_eos=not ignore_eos,
                    )
                )
                in_slot[slot] = Sample(p, s, [], [], [], sampling.describe())
                checked[slot] = 0
            state, first = engine.insert(prefix, state, requests, seed)
            inserts.append(([r.slot for r in requests], first))
        if free:  # slots a stop string ended and nothing refilled: stop them on the device too
            state = engine.release_slots(state, free)
        # tokens each live sample still needs from generate (new samples get their first at insert)
        need = max((max_new_tokens - max(s.length, 1) for s in in_slot if s is not None), default=0)
        steps = []
        for _ in range(min(sync_every, need)):
            state, step = engine.generate(engine.params, state)
            steps.append(step)

        touched = set()
        for slots, first in jax.device_get(inserts):
            for j, slot in enumerate(slots):
                live = in_slot[slot]
                assert live is not None, "a slot just inserted holds its sample"
                _record(live, first, j)
                touched.add(slot)
                emitted += 1
                if first.finished[j]:
                    finish(slot, _reason(live, engine, ignore_eos))
        for step in jax.device_get(steps):
            for slot in np.flatnonzero(step.valid).tolist():
                live = in_slot[slot]
                if live is None:
                    continue
                _record(live, step, slot)
                touched.add(slot)
                emitted += 1
                if step.finished[slot]:
                    finish(slot, _reason(live, engine, ignore_eos))
        for slot in touched:
            if in_slot[slot] is not None:
                finish(slot)
        bar.set_postfix(tokens_per_s=f"{emitted / (time.perf_counter() - start):.0f}", refresh=False)
    bar.close()
    engine.state = engine.release_slots(state, range(c.slots))
    return [[out[(p, s)] for s in range(n)] for p in range(len(prompts))]


def _next_requests(work: collections.deque, free: int, max_prompts: int) -> list[tuple[int, int]]:
    """The next (prompt, sample) pairs of ``work`` for one prefill and insert: as many as there are
    ``free`` slots, from at most ``max_prompts`` distinct prompts. A prompt's samples share its
    prefill row, so n samples of 8 prompts take one prefill of 8 rows, not 8 prefills of one (and
    the prefill has the same shape in a G-sample RL rollout as in a one-sample eval)."""
    batch: list[tuple[int, int]] = []
    prompts: set[int] = set()
    while work and len(batch) < free:
        p = work[0][0]
        if p not in prompts and len(prompts) == max_prompts:
            break
        prompts.add(p)
        batch.append(work.popleft())
    return batch


def _record(sample: Sample, out: StepOutput, i: int) -> None:
    sample.tokens.append(int(out.tokens[i]))
    sample.logprobs.append(float(out.logprobs[i]))
    sample.sampling_logprobs.append(float(out.sampling_logprobs[i]))


def _reason(sample: Sample, engine: RolloutEngine, ignore_eos: bool) -> str:
    return "eos" if not ignore_eos and sample.tokens[-1] in engine.config.eos_ids else "length"
