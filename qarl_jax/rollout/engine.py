r"""The rollout engine core: bucketed prefill, insert into a decode slot, one generate step for all
slots, over a preallocated KV cache. Plain JAX (no JetStream, no TensorFlow).

Shapes are fixed per call family, so compilation is bounded: generate compiles once; prefill once
per (prompt-batch bucket, prompt-length bucket); insert once per (slot-count bucket, length
bucket). Parameters are arguments of every jitted call, never closed over, so ``update_params``
with same-shaped weights never retraces. The KV cache is in the model's compute dtype: the values
the training forward computes for K and V.

Sample randomness is keyed by (seed, prompt index, sample index) and the token's index in the
sample, never by slot or step: a sample's tokens do not depend on what ran beside it.

A :class:`DecodeHook` observes the decode forward without changing it: its ``collect`` runs inside
the jitted prefill and generate calls on the forward's "intermediates" (what the model ``sow``\ s,
e.g. the MoE routing) and the host calls hand it what ``collect`` returned, with the requests each
insert placed, so a tool can file per-token internals by sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from qarl_jax import sharding
from qarl_jax.models import KVCache, Qwen3ForCausalLM
from qarl_jax.rollout import layout
from qarl_jax.rollout.sampling import SamplingParams, sample


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """slots: concurrent sequences; max_len: prompt + generated tokens per slot (cache length)."""

    slots: int = 32
    max_len: int = 512
    prefill_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    max_prefill_batch: int = 8
    eos_ids: tuple[int, ...] = ()
    # a longer prompt is prefilled this many tokens at a time (each chunk attends to the cache the
    # previous ones wrote): activations of one chunk alive, not of the whole prompt; same bits
    prefill_chunk: int = 2048

    def __post_init__(self):
        if self.slots <= 0 or self.max_len <= 1 or self.max_prefill_batch <= 0 or self.prefill_chunk <= 0:
            raise ValueError(f"slots, max_len, max_prefill_batch and prefill_chunk must be positive: {self}")
        if list(self.prefill_buckets) != sorted(set(self.prefill_buckets)) or not self.prefill_buckets:
            raise ValueError(f"prefill_buckets must be increasing, got {self.prefill_buckets}")

    @property
    def length_buckets(self) -> tuple[int, ...]:
        """Prompt-length buckets, capped by the cache length (which is always the last bucket)."""
        return tuple(b for b in self.prefill_buckets if b < self.max_len) + (self.max_len,)

    @property
    def max_prompt_len(self) -> int:
        """Longest prompt that still leaves room for one generated token."""
        return self.max_len - 1


HostOrDevice = jax.Array | np.ndarray  # host columns at insert, device arrays in the state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotSettings:
    """What each slot's sample asked for, one entry per slot (or per request, at insert): set once
    when a sample starts, read by every generate step. One pytree, so adding a setting edits this
    class, :meth:`columns` and the step that reads it."""

    max_new: HostOrDevice  # int32, tokens to generate (capped by the cache room at insert)
    stop_on_eos: HostOrDevice  # bool
    temperature: HostOrDevice  # f32, 0 = greedy
    top_p: HostOrDevice  # f32
    top_k: HostOrDevice  # int32, 0 = no truncation

    @classmethod
    def empty(cls, n: int) -> SlotSettings:
        """Settings of ``n`` empty slots (distinct device buffers: the decode state is donated)."""
        return cls(
            max_new=jnp.zeros((n,), jnp.int32),
            stop_on_eos=jnp.ones((n,), bool),
            temperature=jnp.ones((n,), jnp.float32),
            top_p=jnp.ones((n,), jnp.float32),
            top_k=jnp.zeros((n,), jnp.int32),
        )

    @classmethod
    def columns(cls, requests: Sequence[SlotRequest], size: int) -> SlotSettings:
        """Host columns of the requests' settings, zero-padded to ``size`` rows."""
        return cls(
            max_new=_column([r.max_new for r in requests], size, np.int32),
            stop_on_eos=_column([r.stop_on_eos for r in requests], size, bool),
            temperature=_column([r.sampling.temperature for r in requests], size, np.float32),
            top_p=_column([r.sampling.top_p for r in requests], size, np.float32),
            top_k=_column([r.sampling.top_k for r in requests], size, np.int32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Per slot: the last sampled token (not yet in the cache), its position and bookkeeping.

    ``done`` is True for empty and finished slots; they still run (fixed shapes) but emit nothing."""

    cache: KVCache
    tokens: jax.Array  # [S] int32
    positions: jax.Array  # [S] int32, where ``tokens`` goes in the cache
    keys: jax.Array  # [S, key data] uint32, the sample's key
    generated: jax.Array  # [S] int32, tokens sampled so far (including the first, at insert)
    done: jax.Array  # [S] bool
    settings: SlotSettings


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """Prefilled prompts: their K/V [layers, P, T, kv_heads, head_dim], last logits [P, V], lengths [P]."""

    cache: KVCache
    last_logits: jax.Array
    lengths: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """One token per row: valid marks rows that emitted one; finished marks a sample's last token."""

    tokens: jax.Array
    logprobs: jax.Array  # policy, temperature 1, no truncation
    sampling_logprobs: jax.Array  # under the distribution actually sampled from (0 for greedy)
    valid: jax.Array
    finished: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlotRequest:
    """What ``insert`` needs per slot: a prefix row, the sample's identity and its settings."""

    row: int
    slot: int
    prompt_index: int
    sample_index: int
    max_new: int
    sampling: SamplingParams = SamplingParams()
    stop_on_eos: bool = True


def _column(values: Sequence, size: int, dtype, fill=0) -> np.ndarray:
    """``values`` as a host array of ``size`` rows, the rest ``fill``."""
    out = np.full((size,), fill, dtype)
    out[: len(values)] = values
    return out


class DecodeHook(Protocol):
    """What the engine tells an observer of its decode forward (see the module docstring)."""

    def collect(self, positions: jax.Array, intermediates: dict) -> Any:
        """Traced: the arrays to keep from one forward (``positions`` [rows, T])."""

    def prefilled(self, prompts: Sequence[Sequence[int]], collected: Any) -> None: ...

    def inserted(self, requests: Sequence[SlotRequest]) -> None: ...

    def generated(self, out: StepOutput, collected: Any) -> None: ...


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _pow2_buckets(limit: int) -> tuple[int, ...]:
    out = [1]
    while out[-1] < limit:
        out.append(min(out[-1] * 2, limit))
    return tuple(out)


def sample_key(seed: jax.Array, prompt_index: jax.Array, sample_index: jax.Array) -> jax.Array:
    """The key of sample (prompt_index, sample_index) of a rollout with ``seed``."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), prompt_index), sample_index)


@dataclasses.dataclass(frozen=True)
class Staged:
    """Frozen weights already on the engine's layout (:meth:`RolloutEngine.stage_params`)."""

    tree: Any


class RolloutEngine:
    """Continuous-batching decode over frozen (quantized) weights; see the module docstring."""

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        params,
        config: EngineConfig = EngineConfig(),
        mesh: Mesh | None = None,
        rules=sharding.DEFAULT_RULES,
        hook: DecodeHook | None = None,
    ):
        self.model, self.config, self.mesh, self.rules = model, config, mesh, rules
        self.hook = hook
        self._collected = None  # a traced forward's hook output, read back within the same trace
        concrete = all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))  # else: structs to lower
        # the frozen weights' layout on the engine's mesh (rules' logical axes), moved there once
        # per update (see qarl_jax.rollout.layout); without a mesh they stay where they are
        shardings = None if mesh is None else layout.frozen_shardings(model, params, mesh, rules)
        self.sync = layout.WeightSync(shardings)
        if mesh is None:
            self.params = params
        elif concrete:
            self.params = self.sync(params, donate=False)
        else:  # structs placed as the engine would place arrays (for lowering its programs)
            self.params = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings
            )
        self._owns_params = False  # True after a donated update: release_params may free them
        # shapes and constants without running an op: the engine is also built over TPU device
        # descriptions to compile its programs for a slice with no chip (memory_plan --topology)
        self._key_shape = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape
        self._eos = np.asarray(config.eos_ids or (-1,), np.int32)
        self._prefill = jax.jit(self._with_collected(self._prefill_impl))
        self._insert = jax.jit(self.insert_impl, donate_argnums=(1,))
        self._generate = jax.jit(self._with_collected(self.generate_impl), donate_argnums=(1,))
        self._release = jax.jit(self._release_impl, donate_argnums=(0,))
        # the fresh state made on the devices by a jitted call pinned as the others are: placed
        # exactly as they return it (see state_shardings), and never whole on one device first
        self._fresh = jax.jit(lambda: self._placed(self.empty_state()))
        self.state: DecodeState | None = None

    # ---- weights and memory -------------------------------------------------------------------

    def stage_params(self, params, donate: bool = False) -> Staged:
        """New frozen weights moved to the engine's layout now, while the engine may still decode on
        its current ones (asynchronous rollouts on their own devices); :meth:`update_params` swaps
        them in later without moving them again."""
        return Staged(params if self.mesh is None else self.sync(params, donate=donate))

    def update_params(self, params, donate: bool = False) -> None:
        """Swap in new frozen weights (same tree, shapes and dtypes: no recompilation), moved to the
        engine's layout in one resharding (``donate``: the given arrays may be consumed by it), or
        already moved there by :meth:`stage_params`."""
        staged = isinstance(params, Staged)
        if staged:
            params = params.tree
        old, new = jax.tree.structure(self.params), jax.tree.structure(params)
        if old != new:  # type: ignore[operator]  # PyTreeDef compares by structure; its stub has no __ne__
            raise ValueError(f"update_params: parameter tree differs from the engine's ({new} vs {old})")
        pairs = zip(jax.tree_util.tree_leaves_with_path(self.params), jax.tree.leaves(params), strict=True)
        for (path, a), b in pairs:
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"update_params: {jax.tree_util.keystr(path)} is {b.shape} {b.dtype}, "
                    f"the engine runs {a.shape} {a.dtype}"
                )
        if staged or self.mesh is None:
            self.params = params
        else:
            self.params = self.sync(params, donate=donate)
        self._owns_params = donate or (staged and self.mesh is not None)

    def release_params(self) -> None:
        """Free the engine's copy of the frozen weights (the trainer's phase: they are replaced after
        the update anyway); ``update_params`` brings new ones. Only for weights the engine owns (moved
        into its layout by ``update_params(..., donate=True)``): a caller's arrays are not freed."""
        if self._owns_params:
            for leaf in jax.tree.leaves(self.params):
                leaf.delete()

    def init_decode_state(self) -> DecodeState:
        """A fresh state on the engine's mesh (not the caller's), placed as every call returns it
        (:meth:`state_shardings`): zeroed cache (compute dtype), every slot empty."""
        with self.context():
            if self.mesh is not None:
                return self._fresh()
            # off a mesh: committed beside the weights, as every call's output is (left uncommitted,
            # the fresh state made the next rollout's first insert a second program)
            return jax.device_put(self.empty_state(), jax.tree.leaves(self.params)[0].sharding)

    def empty_state(self) -> DecodeState:
        """The decode state's values before placement (``jax.eval_shape`` of it: its structure)."""
        c, s = self.config, self.config.slots
        zeros = lambda: jnp.zeros((s,), jnp.int32)  # distinct buffers: all are donated
        return DecodeState(
            cache=KVCache.init(self.model.config, s, c.max_len),
            tokens=zeros(),
            positions=zeros(),
            keys=jnp.zeros((s, *self._key_shape), jnp.uint32),
            generated=zeros(),
            done=jnp.ones((s,), bool),
            settings=SlotSettings.empty(s),
        )

    def allocate(self) -> DecodeState:
        """(Re)allocate ``self.state`` if it was released."""
        if self.state is None:
            self.state = self.init_decode_state()
        return self.state

    def release(self) -> None:
        """Free the KV cache (e.g. while the trainer needs the memory); ``allocate`` brings it back."""
        if self.state is not None:
            for leaf in jax.tree.leaves(self.state):
                leaf.delete()
            self.state = None

    # ---- the three calls ----------------------------------------------------------------------

    def prefill(self, params, prompts: Sequence[Sequence[int]]) -> Prefix:
        """Prefill up to ``max_prefill_batch`` prompts (right-padded to a length bucket)."""
        c = self.config
        if not 0 < len(prompts) <= c.max_prefill_batch:
            raise ValueError(f"prefill takes 1..{c.max_prefill_batch} prompts, got {len(prompts)}")
        lengths = [len(p) for p in prompts]
        if min(lengths) < 1 or max(lengths) > c.max_prompt_len:
            raise ValueError(f"prompt lengths must be in [1, {c.max_prompt_len}], got {lengths}")
        rows = bucket(len(prompts), _pow2_buckets(c.max_prefill_batch))
        t = bucket(max(lengths), c.length_buckets)
        tokens = np.zeros((rows, t), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        lens = np.ones((rows,), np.int32)
        lens[: len(prompts)] = lengths
        with self.context():
            prefix = self._prefill(params, tokens, lens)
        if self.hook is not None:
            prefix, collected = prefix
            self.hook.prefilled(prompts, collected)
        return prefix

    def insert(self, prefix: Prefix, state: DecodeState, requests: Sequence[SlotRequest], seed: int):
        """Start samples in slots from prefix rows; samples each one's first token.

        Returns (state, StepOutput [len(requests) padded to a bucket]) for those first tokens."""
        if self.hook is not None:
            self.hook.inserted(requests)
        with self.context():
            return self._insert(prefix, state, self.insert_columns(requests), np.int32(seed))

    def insert_columns(self, requests: Sequence[SlotRequest]) -> dict:
        """The insert call's per-request arrays, padded to a bucket (padding targets no slot)."""
        k = bucket(len(requests), _pow2_buckets(self.config.slots))
        for r in requests:
            if not 0 <= r.slot < self.config.slots:
                raise ValueError(f"slot {r.slot} out of range [0, {self.config.slots})")
        return dict(
            rows=_column([r.row for r in requests], k, np.int32),
            slots=_column([r.slot for r in requests], k, np.int32, fill=self.config.slots),  # dropped
            prompt_index=_column([r.prompt_index for r in requests], k, np.int32),
            sample_index=_column([r.sample_index for r in requests], k, np.int32),
            settings=SlotSettings.columns(requests, k),
        )

    def generate(self, params, state: DecodeState) -> tuple[DecodeState, StepOutput]:
        """One token for every live slot (state donated: the cache is updated in place)."""
        with self.context():
            out = self._generate(params, state)
        if self.hook is None:
            return out
        (state, step), collected = out
        self.hook.generated(step, collected)
        return state, step

    def release_slots(self, state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """Mark slots empty (a sample stopped on the host, e.g. by a stop string)."""
        k = bucket(len(slots), _pow2_buckets(self.config.slots))
        idx = np.full((k,), self.config.slots, np.int32)
        idx[: len(slots)] = slots
        with self.context():
            return self._release(state, idx)

    def kv_cache_bytes_per_device(self) -> int:
        """Bytes of the KV cache (K and V, [layers, slots, max_len, kv_heads, head_dim] in the compute
        dtype, padded as the backend's layout pads them) on one device, sharded as
        :meth:`init_decode_state` places it."""
        c, m = self.config, self.model.config
        with self.context():
            cache = jax.eval_shape(lambda: KVCache.init(m, c.slots, c.max_len))
        shape: tuple[int, ...] = cache.k.shape
        if self.mesh is not None:
            shape = self._cache_sharding(cache).shard_shape(shape)
        return 2 * int(np.prod(shape)) * jnp.dtype(m.dtype).itemsize

    def compilations(self) -> dict[str, int]:
        """How many programs each jitted call has compiled (for no-recompilation checks)."""
        fns = {"prefill": self._prefill, "insert": self._insert, "generate": self._generate}
        return {name: fn._cache_size() for name, fn in fns.items()}  # type: ignore[attr-defined]  # jit's own count

    # ---- jitted bodies (public: adapters fuse them into their own jitted calls) ----

    def state_shardings(self, state: DecodeState) -> DecodeState:
        """Where the decode state lives on the engine's mesh (``state``: the state or its structs):
        the cache as :meth:`_cache_sharding` places it, every per-slot vector split over its slots
        as the cache's slots are. The calls that return the state pin it there
        (:meth:`_placed`), so each returns the state placed as it was given and each call is ONE
        program, compiled once. Why: left to the compiler, a call's output came back placed unlike
        the fresh state, and an engine on a mesh compiled its insert up to twice and its decode step
        up to three times (the same program under each input placement: seconds on CPU, minutes
        at scale)."""
        assert self.mesh is not None  # only called for an engine on a mesh
        mesh, rules = self.mesh, self.rules
        slots = lambda x: sharding.fitting_spec(x.shape, ("batch",) + (None,) * (x.ndim - 1), mesh, rules)  # noqa: E731
        placed = jax.tree.map(lambda x: NamedSharding(mesh, slots(x)), state)
        kv = self._cache_sharding(state.cache)
        return dataclasses.replace(placed, cache=jax.tree.map(lambda _: kv, state.cache))

    def _placed(self, state: DecodeState) -> DecodeState:
        """``state`` pinned to :meth:`state_shardings` inside a jitted body (as is, off a mesh)."""
        if self.mesh is None:
            return state
        return jax.lax.with_sharding_constraint(state, self.state_shardings(state))

    def _cache_sharding(self, cache: KVCache) -> NamedSharding:
        """Slots over the batch axes and KV heads over tensor, where they divide evenly (``cache``:
        the cache or its structs, whose layout says which axis is which)."""
        assert self.mesh is not None  # only called for an engine on a mesh
        return NamedSharding(
            self.mesh, sharding.fitting_spec(cache.k.shape, cache.axes, self.mesh, self.rules)
        )

    def context(self):
        """The engine's mesh and logical rules (every jitted call runs inside it)."""
        return sharding.activate(self.mesh, self.rules) if self.mesh is not None else contextlib.nullcontext()

    def _apply_decode(self, params, tokens, positions, cache, method: str = "decode"):
        variables = {"params": params}
        if self.hook is None:
            return self.model.apply(variables, tokens, positions, cache, method=method)
        out, state = self.model.apply(
            variables, tokens, positions, cache, method=method, mutable=["intermediates"]
        )
        self._collected = self.hook.collect(positions, state["intermediates"])
        return out

    def _with_collected(self, fn: Callable) -> Callable:
        """``fn``, returning also what the hook collected in its trace (``fn`` itself without a hook)."""
        if self.hook is None:
            return fn

        def call(*args):
            out = fn(*args)
            collected, self._collected = self._collected, None
            return out, collected

        return call

    def _prefill_impl(self, params, tokens, lengths) -> Prefix:
        """The prompts' K/V and the logits after each one's last token. A bucket longer than
        ``prefill_chunk`` runs in a scan over chunks of it (the last chunk padded: positions past
        the cache are dropped), each keeping only the final-norm hidden state at its rows' last
        prompt token; the head then runs once on those. Every kernel is row-wise and the cache
        layout is the decode step's, so the bits are those of one whole-prompt call. With a hook,
        whole prompts: it reads the intermediates of one traced forward."""
        p, t = tokens.shape
        cache = KVCache.init(self.model.config, p, t)
        chunk = t if self.hook is not None else min(t, self.config.prefill_chunk)
        n = -(-t // chunk)
        positions = jnp.broadcast_to(jnp.arange(n * chunk, dtype=jnp.int32), (p, n * chunk))
        tokens = jnp.pad(tokens, ((0, 0), (0, n * chunk - t)))
        split = lambda v: jnp.swapaxes(v.reshape(p, n, chunk), 0, 1)  # noqa: E731
        hdim = self.model.config.hidden_size

        def step(carry, chunk_in):
            cache, last = carry
            toks, pos = chunk_in
            hidden, cache = self._apply_decode(params, toks, pos, cache, method="decode_hidden")
            at = lengths - 1 - pos[:, 0]  # the last prompt token's index within this chunk
            pick = jnp.take_along_axis(hidden, jnp.clip(at, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
            return (cache, jnp.where(((at >= 0) & (at < chunk))[:, None], pick, last)), None

        init = (cache, jnp.zeros((p, hdim), jnp.dtype(self.model.config.dtype)))
        if n == 1:
            (cache, last), _ = step(init, (tokens, positions))
        else:
            (cache, last), _ = jax.lax.scan(step, init, (split(tokens), split(positions)))
        logits = jnp.asarray(self.model.apply({"params": params}, last[:, None], method="head"))[:, 0]
        return Prefix(cache=cache, last_logits=logits.astype(jnp.float32), lengths=lengths)

    def insert_impl(self, prefix: Prefix, state: DecodeState, cols, seed):
        rows, slots = cols["rows"], cols["slots"]
        t, to = prefix.cache.max_len, state.cache.layout
        put = lambda dst, src: to.put(dst, slots, src, rows, t)  # noqa: E731
        cache = KVCache(put(state.cache.k, prefix.cache.k), put(state.cache.v, prefix.cache.v), to)
        keys = jax.vmap(sample_key, in_axes=(None, 0, 0))(seed, cols["prompt_index"], cols["sample_index"])
        first_keys = jax.vmap(jax.random.fold_in)(keys, jnp.zeros_like(rows))
        new: SlotSettings = cols["settings"]
        new = dataclasses.replace(
            new,
            max_new=jnp.minimum(new.max_new, self.config.max_len - prefix.lengths[rows]),  # cache room
        )
        tokens, lp, slp = sample(prefix.last_logits[rows], first_keys, new.temperature, new.top_p, new.top_k)
        finished = (new.max_new <= 1) | (new.stop_on_eos & jnp.isin(tokens, self._eos))
        set_ = lambda arr, v: arr.at[slots].set(v, mode="drop")
        state = DecodeState(
            cache=cache,
            tokens=set_(state.tokens, tokens),
            positions=set_(state.positions, prefix.lengths[rows]),
            keys=set_(state.keys, jax.random.key_data(keys)),
            generated=set_(state.generated, jnp.ones_like(rows)),
            done=set_(state.done, finished),
            settings=jax.tree.map(set_, state.settings, new),
        )
        valid = slots < self.config.slots
        return self._placed(state), StepOutput(tokens, lp, slp, valid, finished & valid)

    def generate_impl(self, params, state: DecodeState):
        tokens, positions = state.tokens[:, None], state.positions[:, None]
        logits, cache = self._apply_decode(params, tokens, positions, state.cache)
        keys = jax.random.wrap_key_data(state.keys)
        step_keys = jax.vmap(jax.random.fold_in)(keys, state.generated)
        st = state.settings
        tokens, lp, slp = sample(logits[:, 0], step_keys, st.temperature, st.top_p, st.top_k)
        live = ~state.done
        generated = state.generated + live
        finished = live & ((generated >= st.max_new) | (st.stop_on_eos & jnp.isin(tokens, self._eos)))
        state = dataclasses.replace(
            state,
            cache=cache,
            tokens=jnp.where(live, tokens, state.tokens),
            positions=state.positions + live,
            generated=generated,
            done=state.done | finished,
        )
        return self._placed(state), StepOutput(tokens, lp, slp, live, finished)

    def _release_impl(self, state: DecodeState, slots):
        return self._placed(dataclasses.replace(state, done=state.done.at[slots].set(True, mode="drop")))
