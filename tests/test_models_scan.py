"""Scanned layers (``TransformerConfig.scan_layers``): the stacked layout, its bits (the same as the
per-layer model's, training forward and KV-cache decode alike, so rollout == training still holds),
remat policies, Hugging Face import/export, routing read-back, sharding and orbax checkpoints."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from qarl_jax import sharding
from qarl_jax.models import KVCache, Qwen3ForCausalLM, from_pretrained, init_params, preset, save_pretrained
from qarl_jax.models.qwen3 import DecoderLayer, _layer_class
from qarl_jax.models.stacking import layer_location, layer_runs, stack_layers, unstack_layers
from qarl_jax.quant import QuantSpec, quantize_params
from qarl_jax.rl.alignment import generated_logprobs, pack
from qarl_jax.rl.logprobs import policy_logprobs
from qarl_jax.rl.train_step import TrainState
from qarl_jax.rollout import EngineConfig, RolloutEngine, SamplingParams
from qarl_jax.rollout import rollout as engine_rollout
from qarl_jax.run.checkpoint import Checkpointer
from qarl_jax.tools.routing import routed_experts

# two runs: dense layers 0-1 (a stack of 2), MoE layer 2
MIXED = preset("qwen3-moe-tiny", num_hidden_layers=3, mlp_only_layers=(0, 1))


def _jit(fn, *args):
    """``fn(*args)`` as one compiled program: run eagerly, a tree function compiles each of its ops
    for each leaf shape (hundreds of small compiles); the run loop quantizes under jit too."""
    return jax.jit(fn)(*args)


def _stack(config, params):
    """Per-layer params and their stacked copy for the scanned config."""
    return config, params, _jit(lambda p: stack_layers(p, config.replace(scan_layers=True)), params)


def _quantized(params, spec):
    return _jit(lambda p: quantize_params(p, spec), params)


@functools.cache
def _mixed():
    """MIXED's per-layer params and their stacked copy: the module's one model init (its compile is
    a forward's); the 1-layer MoE and 2-layer dense models below take their layers from it."""
    return _stack(MIXED, init_params(Qwen3ForCausalLM(MIXED), jax.random.key(3)))


def _sub_model(layers: tuple[int, ...], mlp_only_layers: tuple[int, ...]):
    """MIXED's embedding, final norm, head and the given layers as a model of its own: the same
    shapes and initialisation as an init of that config, without compiling one."""
    _, mixed, _ = _mixed()
    config = MIXED.replace(num_hidden_layers=len(layers), mlp_only_layers=mlp_only_layers)
    params = {k: v for k, v in mixed.items() if not k.startswith("layers_")}
    params.update({f"layers_{i}": mixed[f"layers_{j}"] for i, j in enumerate(layers)})
    return config, params


def test_layer_runs_and_locations():
    dense = preset("qwen3-tiny")
    assert layer_runs(dense) == ((0, 4),)
    moe = preset("qwen3-moe-tiny")  # layer 0 dense (mlp_only_layers)
    assert layer_runs(moe) == ((0, 1), (1, 4))
    sparse2 = moe.replace(mlp_only_layers=(), decoder_sparse_step=2)  # layers 1, 3 sparse
    assert layer_runs(sparse2) == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert layer_location(moe, 2) == ("layers_2", None)
    assert layer_location(moe.replace(scan_layers=True), 2) == ("stack_1_4", 1)
    with pytest.raises(ValueError, match="layer 4 is out of range"):
        layer_location(moe, 4)
    with pytest.raises(ValueError, match="remat_policy"):
        dense.replace(remat_policy="some")


def test_scanned_decode_is_bitwise_the_per_layer_model():
    """Same weights, stacked: the scanned init has the stacked tree's structure and shapes; the
    prefill and decode-step logits and the KV cache are bit for bit the per-layer model's (the
    training forward: test_remat_policies_keep_logprobs_and_gradients)."""
    config, params, stacked = _mixed()
    assert layer_runs(config) == ((0, 2), (2, 3))
    scfg = config.replace(scan_layers=True)
    shapes = jax.eval_shape(lambda: init_params(Qwen3ForCausalLM(scfg), jax.random.key(0)))
    assert jax.tree.structure(shapes) == jax.tree.structure(stacked)
    assert [a.shape for a in jax.tree.leaves(shapes)] == [a.shape for a in jax.tree.leaves(stacked)]
    jax.tree.map(np.testing.assert_array_equal, _jit(lambda s: unstack_layers(s, scfg), stacked), params)

    tokens = jax.random.randint(jax.random.key(1), (2, 13), 0, config.vocab_size)
    spec = QuantSpec("w4a16")
    per_layer, scanned = Qwen3ForCausalLM(config, spec), Qwen3ForCausalLM(scfg, spec)

    def decode(model, frozen):
        step = jax.jit(lambda p, t, pos, c: model.apply({"params": p}, t, pos, c, method="decode"))
        pos = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (2, 13))
        logits, cache = step(frozen, tokens[:, :11], pos[:, :11], KVCache.init(model.config, 2, 16))
        outs = [logits]
        for t in range(11, 13):
            logits, cache = step(frozen, tokens[:, t : t + 1], pos[:, t : t + 1], cache)
            outs.append(logits)
        return jnp.concatenate(outs, axis=1), cache

    a_logits, a_cache = decode(per_layer, _quantized(params, per_layer.quant))
    b_logits, b_cache = decode(scanned, _quantized(stacked, scanned.quant))
    np.testing.assert_array_equal(b_logits, a_logits)
    np.testing.assert_array_equal(b_cache.k, a_cache.k)
    np.testing.assert_array_equal(b_cache.v, a_cache.v)


def test_scanned_engine_rollout_equals_scanned_training_bitwise():
    """The core promise on the scanned MoE model: the engine's recorded sampling log-probs (frozen
    w4a16 stacked weights, KV cache, temperature 0.7) are what the scanned training forward
    computes from the master weights, packed two sequences a row."""
    config, _, stacked = _mixed()
    model = Qwen3ForCausalLM(config.replace(scan_layers=True), QuantSpec("w4a16"))
    engine = RolloutEngine(model, _quantized(stacked, model.quant), EngineConfig(slots=4, max_len=32))
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, config.vocab_size, n).tolist() for n in (3, 4)]
    groups = engine_rollout(engine, prompts, 2, 5, SamplingParams(0.7), ignore_eos=True, progress=False)
    samples = [s for group in groups for s in group]
    seqs = [np.asarray(prompts[s.prompt_index] + s.tokens, np.int32) for s in samples]
    batch = pack(seqs, 2, 32)
    args = [jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids", "targets")]
    logp = jax.jit(lambda p: policy_logprobs(model, p, *args, 0.7, remat=True))(stacked)
    own = [prompts[s.prompt_index] for s in samples]
    for t, s in zip(generated_logprobs(np.asarray(logp), batch, own, seqs), samples, strict=True):
        np.testing.assert_array_equal(t, np.asarray(s.sampling_logprobs, np.float32))


@pytest.mark.slow
def test_remat_policies_keep_logprobs_and_gradients():
    """full / save_dots on the scanned model, under value_and_grad: the aux log-probs equal the
    per-layer model's without remat bit for bit, the gradients match it (allclose)."""
    config, params, stacked = _stack(*_sub_model((0, 1), (0, 1)))  # MIXED's two dense layers
    tokens = jax.random.randint(jax.random.key(2), (2, 11), 0, config.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)

    def grad_fn(model, remat):
        def loss(p):
            logp = policy_logprobs(model, p, tokens, None, None, targets, remat=remat)
            return jnp.sum(logp), logp

        return jax.jit(jax.value_and_grad(loss, has_aux=True))

    (_, ref_logp), ref_grads = grad_fn(Qwen3ForCausalLM(config, QuantSpec("w4a16")), False)(params)
    ref_grads = _jit(lambda g: stack_layers(g, config.replace(scan_layers=True)), ref_grads)
    assert _layer_class(config.replace(remat_policy="none"), True) is DecoderLayer  # remat off
    for policy in ("full", "save_dots"):
        model = Qwen3ForCausalLM(config.replace(scan_layers=True, remat_policy=policy), QuantSpec("w4a16"))
        (_, logp), grads = grad_fn(model, True)(stacked)
        np.testing.assert_array_equal(logp, ref_logp)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()) + 1e-30)
    q = grads["stack_0_2"]["self_attn"]["q_proj"]["kernel"]
    assert q.shape[0] == 2 and float(jnp.abs(q[1]).max()) > 0


def test_hf_export_import_of_the_stacked_layout(tmp_path):
    """A scanned model's export is the per-layer model's checkpoint (the Hub layout); loading it
    with scan_layers=True gives the stacked tree."""
    config, params, stacked = _mixed()
    scfg = config.replace(scan_layers=True)
    save_pretrained(tmp_path / "stacked", scfg, stacked, max_shard_bytes=1 << 20)
    model, loaded, _ = from_pretrained(tmp_path / "stacked")
    assert not model.config.scan_layers
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
    model, loaded, _ = from_pretrained(tmp_path / "stacked", scan_layers=True)
    assert model.config.scan_layers and jax.tree.structure(loaded) == jax.tree.structure(stacked)
    jax.tree.map(np.testing.assert_array_equal, loaded, stacked)


def test_routing_read_back_and_sharding_of_stacks():
    """routed_experts gives the same [B, T, MoE layers, top_k] from a scanned forward; the stacked
    axis is replicated ("layers" -> None), the others keep their rules."""
    config, params, stacked = _mixed()
    scfg = config.replace(scan_layers=True)
    tokens = jax.random.randint(jax.random.key(4), (2, 9), 0, config.vocab_size)

    def routes(model, p):
        _, state = model.apply({"params": p}, tokens, mutable=["intermediates"])
        return routed_experts(state["intermediates"])

    a, b = (
        jax.jit(functools.partial(routes, m))(p)
        for m, p in ((Qwen3ForCausalLM(config), params), (Qwen3ForCausalLM(scfg), stacked))
    )
    assert b.shape == (2, 9, 1, config.num_experts_per_tok)
    np.testing.assert_array_equal(b, a)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    shard = sharding.param_shardings(Qwen3ForCausalLM(scfg), mesh)
    assert shard["stack_0_2"]["self_attn"]["q_proj"]["kernel"].spec == P(None, "fsdp", "tensor")
    experts = shard["stack_2_3"]["mlp"]["experts"]["up_proj"]["kernel"]
    assert experts.spec == P(None, "expert", "fsdp", "tensor")


def test_orbax_round_trip_of_a_stacked_state(tmp_path):
    _, _, stacked = _mixed()
    state = TrainState(params=stacked, opt_state={}, step=jnp.asarray(5, jnp.int32))
    ckpt = Checkpointer(tmp_path, keep=1, config={"model": {"scan_layers": True}})
    ckpt.save(5, state, {"pos": 1}, seed=0)
    ckpt.close()
    like = jax.tree.map(jnp.zeros_like, state)
    restored = Checkpointer(tmp_path, keep=1, config={"model": {"scan_layers": True}}).restore(like)
    assert restored.step == 5
    jax.tree.map(np.testing.assert_array_equal, restored.state.params, stacked)


def test_scanned_bf16_compute_with_f32_params_traces():
    """The scan's carry keeps the compute dtype (plain XLA matmuls on f32 params would promote it)."""
    config = preset("qwen3-moe-tiny", scan_layers=True, dtype="bfloat16")
    for spec in (None, QuantSpec("w4a16")):
        model = Qwen3ForCausalLM(config, spec)
        params = jax.eval_shape(lambda m=model: init_params(m, jax.random.key(0)))
        hidden = jax.eval_shape(
            lambda p, m=model: m.apply({"params": p}, jnp.zeros((1, 8), jnp.int32), method="hidden"), params
        )
        assert hidden.dtype == jnp.bfloat16


def test_moe_token_chunks_are_bitwise_the_whole_layer(monkeypatch):
    """26 tokens through MoE chunks of 8 (the last one padded): the training log-probs equal the
    one-chunk layer's bit for bit, also under value_and_grad, and the gradients match it. One
    layer, the MoE one (the embedding's gradient comes back through the chunks): the two compiles of
    the differentiated forward are this test's time, and per layer."""
    from qarl_jax.models import moe

    config, params = _sub_model((2,), ())  # MIXED's MoE layer
    model = Qwen3ForCausalLM(config, QuantSpec("w4a16"))
    tokens = jax.random.randint(jax.random.key(5), (2, 13), 0, config.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)

    def run():
        def loss(p):
            logp = policy_logprobs(model, p, tokens, None, None, targets, remat=True)
            return jnp.sum(logp), logp

        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (_, whole), whole_grads = run()
    monkeypatch.setattr(moe, "MOE_CHUNK_TOKENS", 8)
    (_, chunked), grads = run()
    np.testing.assert_array_equal(chunked, whole)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(whole_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()) + 1e-30)
