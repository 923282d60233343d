"""The rollout engine core: bucketed prefill, insert into a decode slot, one generate step for all
slots, over a preallocated KV cache. Plain JAX (no JetStream, no TensorFlow).

Shapes are fixed per call family, so compilation is bounded: generate compiles once; prefill once
per (prompt-batch bucket, prompt-length bucket); insert once per (slot-count bucket, length
bucket). Parameters are arguments of every jitted call, never closed over, so ``update_params``
with same-shaped weights never retraces. The KV cache is in the model's compute dtype: the values
the training forward computes for K and V.

Sample randomness is keyed by (seed, prompt index, sample index) and the token's index in the
sample, never by slot or step: a sample's tokens do not depend on what ran beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qarl_jax import sharding
from qarl_jax.models import KVCache, Qwen3ForCausalLM
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
    max_new: jax.Array  # [S] int32
    stop_on_eos: jax.Array  # [S] bool
    done: jax.Array  # [S] bool
    temperature: jax.Array  # [S] f32
    top_p: jax.Array  # [S] f32
    top_k: jax.Array  # [S] int32


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


@dataclasses.dataclass(frozen=True)
class SlotRequest:
    """What ``insert`` needs per slot: a prefix row, the sample's identity and its settings."""

    row: int
    slot: int
    prompt_index: int
    sample_index: int
    max_new: int
    sampling: SamplingParams = SamplingParams()
    stop_on_eos: bool = True


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


class RolloutEngine:
    """Continuous-batching decode over frozen (quantized) weights; see the module docstring."""

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        params,
        config: EngineConfig = EngineConfig(),
        mesh: Mesh | None = None,
        rules=sharding.DEFAULT_RULES,
    ):
        self.model, self.config, self.mesh, self.rules = model, config, mesh, rules
        self.params = params
        self._param_shardings = jax.tree.map(lambda x: x.sharding, params)
        self._key_shape = jax.random.key_data(jax.random.key(0)).shape
        self._eos = jnp.asarray(config.eos_ids or (-1,), jnp.int32)
        self._prefill = jax.jit(self._prefill_impl)
        self._insert = jax.jit(self.insert_impl, donate_argnums=(1,))
        self._generate = jax.jit(self.generate_impl, donate_argnums=(1,))
        self._release = jax.jit(self._release_impl, donate_argnums=(0,))
        self.state: DecodeState | None = None

    # ---- weights and memory -------------------------------------------------------------------

    def update_params(self, params) -> None:
        """Swap in new frozen weights (same tree, shapes and dtypes: no recompilation), placed on
        the engine's shardings (resharded from the trainer's mesh when it differs)."""
        old, new = jax.tree.structure(self.params), jax.tree.structure(params)
        if old != new:
            raise ValueError(f"update_params: parameter tree differs from the engine's ({new} vs {old})")
        pairs = zip(jax.tree_util.tree_leaves_with_path(self.params), jax.tree.leaves(params), strict=True)
        for (path, a), b in pairs:
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"update_params: {jax.tree_util.keystr(path)} is {b.shape} {b.dtype}, "
                    f"the engine runs {a.shape} {a.dtype}"
                )
        self.params = jax.tree.map(
            lambda x, s: x if getattr(x, "sharding", None) == s else jax.device_put(x, s),
            params,
            self._param_shardings,
        )

    def init_decode_state(self) -> DecodeState:
        """A fresh state on the engine's mesh (not the caller's): zeroed cache (compute dtype),
        every slot empty."""
        c, s = self.config, self.config.slots
        with self.context():
            cache = KVCache.init(self.model.config, s, c.max_len)
            if self.mesh is not None:
                cache = jax.device_put(cache, self._cache_sharding(cache.k.shape))
            zeros = lambda: jnp.zeros((s,), jnp.int32)  # noqa: E731  (distinct buffers: all are donated)
            return DecodeState(
                cache=cache,
                tokens=zeros(),
                positions=zeros(),
                keys=jnp.zeros((s, *self._key_shape), jnp.uint32),
                generated=zeros(),
                max_new=zeros(),
                stop_on_eos=jnp.ones((s,), bool),
                done=jnp.ones((s,), bool),
                temperature=jnp.ones((s,), jnp.float32),
                top_p=jnp.ones((s,), jnp.float32),
                top_k=zeros(),
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
            return self._prefill(params, tokens, lens)

    def insert(self, prefix: Prefix, state: DecodeState, requests: Sequence[SlotRequest], seed: int):
        """Start samples in slots from prefix rows; samples each one's first token.

        Returns (state, StepOutput [len(requests) padded to a bucket]) for those first tokens."""
        with self.context():
            return self._insert(prefix, state, self.insert_columns(requests), np.int32(seed))

    def insert_columns(self, requests: Sequence[SlotRequest]) -> dict[str, np.ndarray]:
        """The insert call's per-request arrays, padded to a bucket (padding targets no slot)."""
        k = bucket(len(requests), _pow2_buckets(self.config.slots))
        fields = dict(
            rows=np.int32,
            prompt_index=np.int32,
            sample_index=np.int32,
            max_new=np.int32,
            top_k=np.int32,
            stop_on_eos=bool,
            temperature=np.float32,
            top_p=np.float32,
        )
        cols = {name: np.zeros((k,), dtype) for name, dtype in fields.items()}
        cols["slots"] = np.full((k,), self.config.slots, np.int32)  # out of range: dropped
        for i, r in enumerate(requests):
            if not 0 <= r.slot < self.config.slots:
                raise ValueError(f"slot {r.slot} out of range [0, {self.config.slots})")
            vals = dict(
                rows=r.row,
                slots=r.slot,
                prompt_index=r.prompt_index,
                sample_index=r.sample_index,
                max_new=r.max_new,
                top_k=r.sampling.top_k,
                stop_on_eos=r.stop_on_eos,
                temperature=r.sampling.temperature,
                top_p=r.sampling.top_p,
            )
            for name, v in vals.items():
                cols[name][i] = v
        return cols

    def generate(self, params, state: DecodeState) -> tuple[DecodeState, StepOutput]:
        """One token for every live slot (state donated: the cache is updated in place)."""
        with self.context():
            return self._generate(params, state)

    def release_slots(self, state: DecodeState, slots: Sequence[int]) -> DecodeState:
        """Mark slots empty (a sample stopped on the host, e.g. by a stop string)."""
        k = bucket(len(slots), _pow2_buckets(self.config.slots))
        idx = np.full((k,), self.config.slots, np.int32)
        idx[: len(slots)] = slots
        with self.context():
            return self._release(state, idx)

    def kv_cache_bytes_per_device(self) -> int:
        """Bytes of the KV cache (K and V, [layers, slots, max_len, kv_heads, head_dim] in the compute
        dtype) on one device, sharded as :meth:`init_decode_state` places it."""
        c, m = self.config, self.model.config
        shape = (m.num_hidden_layers, c.slots, c.max_len, m.num_key_value_heads, m.head_dim)
        if self.mesh is not None:
            shape = self._cache_sharding(shape).shard_shape(shape)
        return 2 * int(np.prod(shape)) * jnp.dtype(m.dtype).itemsize

    def compilations(self) -> dict[str, int]:
        """How many programs each jitted call has compiled (for no-recompilation checks)."""
        fns = {"prefill": self._prefill, "insert": self._insert, "generate": self._generate}
        return {name: fn._cache_size() for name, fn in fns.items()}

    # ---- jitted bodies (public: adapters fuse them into their own jitted calls) ----

    def _cache_sharding(self, shape) -> NamedSharding:
        """Slots over the batch axes and KV heads over tensor, where they divide evenly."""
        spec = nn.logical_to_mesh_axes((None, "batch", None, "kv_heads", None), self.rules)
        fit = []
        for dim, axes in zip(shape, spec, strict=True):
            names = (axes,) if isinstance(axes, str) else tuple(axes or ())
            size = int(np.prod([self.mesh.shape[a] for a in names]))
            fit.append(axes if dim % size == 0 else None)
        return NamedSharding(self.mesh, PartitionSpec(*fit))

    def context(self):
        """The engine's mesh and logical rules (every jitted call runs inside it)."""
        return sharding.activate(self.mesh, self.rules) if self.mesh is not None else contextlib.nullcontext()

    def _apply_decode(self, params, tokens, positions, cache):
        return self.model.apply({"params": params}, tokens, positions, cache, method="decode")

    def _apply_decode_hidden(self, params, tokens, positions, cache):
        return self.model.apply({"params": params}, tokens, positions, cache, method="decode_hidden")

    def _prefill_chunk(self, t: int) -> int:
        return self.config.prefill_chunk

    def _prefill_impl(self, params, tokens, lengths) -> Prefix:
        """The prompts' K/V and the logits after each one's last token. A bucket longer than
        ``prefill_chunk`` runs in a scan over chunks of it (the last chunk padded: positions past
        the cache are dropped), each keeping only the final-norm hidden state at its rows' last
        prompt token; the head then runs once on those. Every kernel is row-wise and the cache
        layout is the decode step's, so the bits are those of one whole-prompt call."""
        p, t = tokens.shape
        cache = KVCache.init(self.model.config, p, t)
        chunk = min(t, self._prefill_chunk(t))
        n = -(-t // chunk)
        positions = jnp.broadcast_to(jnp.arange(n * chunk, dtype=jnp.int32), (p, n * chunk))
        tokens = jnp.pad(tokens, ((0, 0), (0, n * chunk - t)))
        split = lambda v: jnp.swapaxes(v.reshape(p, n, chunk), 0, 1)  # noqa: E731
        hdim = self.model.config.hidden_size

        def step(carry, chunk_in):
            cache, last = carry
            toks, pos = chunk_in
            hidden, cache = self._apply_decode_hidden(params, toks, pos, cache)
            at = lengths - 1 - pos[:, 0]  # the last prompt token's index within this chunk
            pick = jnp.take_along_axis(hidden, jnp.clip(at, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
            return (cache, jnp.where(((at >= 0) & (at < chunk))[:, None], pick, last)), None

        init = (cache, jnp.zeros((p, hdim), jnp.dtype(self.model.config.dtype)))
        if n == 1:
            (cache, last), _ = step(init, (tokens, positions))
        else:
            (cache, last), _ = jax.lax.scan(step, init, (split(tokens), split(positions)))
        logits = self.model.apply({"params": params}, last[:, None], method="head")[:, 0]
        return Prefix(cache=cache, last_logits=logits.astype(jnp.float32), lengths=lengths)

    def insert_impl(self, prefix: Prefix, state: DecodeState, cols, seed):
        rows, slots = cols["rows"], cols["slots"]
        t = prefix.cache.k.shape[2]
        put = lambda dst, src: dst.at[:, slots, :t].set(src[:, rows].astype(dst.dtype), mode="drop")  # noqa: E731
        cache = KVCache(k=put(state.cache.k, prefix.cache.k), v=put(state.cache.v, prefix.cache.v))
        keys = jax.vmap(sample_key, in_axes=(None, 0, 0))(seed, cols["prompt_index"], cols["sample_index"])
        first_keys = jax.vmap(jax.random.fold_in)(keys, jnp.zeros_like(rows))
        tokens, lp, slp = sample(
            prefix.last_logits[rows], first_keys, cols["temperature"], cols["top_p"], cols["top_k"]
        )
        max_new = jnp.minimum(cols["max_new"], self.config.max_len - prefix.lengths[rows])  # cache room
        finished = (max_new <= 1) | (cols["stop_on_eos"] & jnp.isin(tokens, self._eos))
        set_ = lambda arr, v: arr.at[slots].set(v, mode="drop")  # noqa: E731
        state = DecodeState(
            cache=cache,
            tokens=set_(state.tokens, tokens),
            positions=set_(state.positions, prefix.lengths[rows]),
            keys=set_(state.keys, jax.random.key_data(keys)),
            generated=set_(state.generated, jnp.ones_like(rows)),
            max_new=set_(state.max_new, max_new),
            stop_on_eos=set_(state.stop_on_eos, cols["stop_on_eos"]),
            done=set_(state.done, finished),
            temperature=set_(state.temperature, cols["temperature"]),
            top_p=set_(state.top_p, cols["top_p"]),
            top_k=set_(state.top_k, cols["top_k"]),
        )
        valid = slots < self.config.slots
        return state, StepOutput(tokens, lp, slp, valid, finished & valid)

    def generate_impl(self, params, state: DecodeState):
        tokens, positions = state.tokens[:, None], state.positions[:, None]
        logits, cache = self._apply_decode(params, tokens, positions, state.cache)
        keys = jax.random.wrap_key_data(state.keys)
        step_keys = jax.vmap(jax.random.fold_in)(keys, state.generated)
        tokens, lp, slp = sample(logits[:, 0], step_keys, state.temperature, state.top_p, state.top_k)
        live = ~state.done
        generated = state.generated + live
        finished = live & ((generated >= state.max_new) | (state.stop_on_eos & jnp.isin(tokens, self._eos)))
        state = dataclasses.replace(
            state,
            cache=cache,
            tokens=jnp.where(live, tokens, state.tokens),
            positions=state.positions + live,
            generated=generated,
            done=state.done | finished,
        )
        return state, StepOutput(tokens, lp, slp, live, finished)

    def _release_impl(self, state: DecodeState, slots):
        return dataclasses.replace(state, done=state.done.at[slots].set(True, mode="drop"))
