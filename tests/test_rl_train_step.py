"""The training step: aligned old log-probs (scored in micro-batch chunks without changing a bit),
updates, the NaN guard, minibatches moving the policy, the KL to the initial policy, the sharded step
equal to the single-device one, and TBPO raising a reward.

Compiling a step is most of each test's time (XLA:CPU, seconds a program), so the tests share
programs: one rollout batch and engine (``setup``), one single-device step of the whole batch
(``step``: the reference of the micro-batch, sharded, NaN and padding tests) and one run of 2
minibatches x 2 epochs (``epochs``: the minibatch, KL, old-log-prob, staleness and reward tests),
and the tests' other trainers take the same configurations (the learning rate is a constant of the
program) so the run's compilation cache serves them."""

import dataclasses
import functools
import re

import jax
import numpy as np
import pytest

from kernels_pallas import rowwise
from kernels_pallas._tiling import rows_per_block
from qarl_jax import quant, sharding
from qarl_jax.models import Qwen3ForCausalLM, init_params, layer_major, preset
from qarl_jax.models.qwen3 import fused_block_rows
from qarl_jax.rl.advantages import group_advantages
from qarl_jax.rl.batch import training_batch
from qarl_jax.rl.objectives import ObjectiveConfig, normalisers
from qarl_jax.rl.train_step import OptimizerConfig, TrainConfig, Trainer, accumulate
from qarl_jax.rollout import EngineConfig, RolloutEngine, SamplingParams, rollout

PROMPT, NEW = 4, 6


def _policy(fmt="w4a16", **overrides):
    """A 1-layer policy: every claim here is about the step around the forward (scoring chunks,
    accumulation, the optimizer, the sharded layout), none about depth, and each layer is a copy of
    its kernels in every compiled step (the scanned and layer-major passes: test_models_scan,
    test_layer_major). The master weights come from the unquantized model's init: the same bits,
    and flax's init runs a forward, which the quantized model's would compile quantized."""
    config = preset("qwen3-tiny", num_hidden_layers=1, **overrides)
    model = Qwen3ForCausalLM(config, quant.QuantSpec(fmt=fmt))
    return model, init_params(Qwen3ForCausalLM(config), jax.random.key(0))


@functools.cache
def _freezer(spec: quant.QuantSpec):
    """The engine's frozen weights of master params, quantized in one compiled program as the run
    loop does (eagerly, each op compiles on its own for each leaf shape)."""
    return jax.jit(lambda p: quant.quantize_params(p, spec))


def _rollouts(model, params, n_prompts=4, n=4, seed=0, engine=None):
    """Sampled rollouts from the engine with frozen weights (``engine``'s, given one, after handing
    it these: its compiled programs are reused); reward = share of response tokens < 32 (a quarter
    of the vocabulary: about 0.25 for the random policy)."""
    frozen = _freezer(model.quant)(params)
    if engine is None:
        engine = RolloutEngine(model, frozen, EngineConfig(slots=8, max_len=PROMPT + NEW))
    else:
        engine.update_params(frozen)
    prompts = np.random.RandomState(seed).randint(0, 128, (n_prompts, PROMPT)).tolist()
    sampling = SamplingParams(temperature=1.0)
    out = rollout(engine, prompts, n=n, max_new_tokens=NEW, sampling=sampling, seed=seed, ignore_eos=True)
    samples = [s for group in out for s in group]
    rewards = np.asarray([np.mean(np.asarray(s.tokens) < 32) for s in samples]).reshape(n_prompts, n)
    adv = np.asarray(group_advantages(rewards)).reshape(-1)
    responses, logprobs = [s.tokens for s in samples], [s.logprobs for s in samples]
    repeated = [p for p in prompts for _ in range(n)]
    truncated = [s.finish_reason == "length" for s in samples]  # all of them: EOS is ignored
    batch = training_batch(repeated, responses, logprobs, adv, PROMPT + NEW - 1, truncated=truncated)
    return batch, float(rewards.mean())


@pytest.fixture(scope="module")
def setup():
    model, params = _policy()
    engine = RolloutEngine(model, _freezer(model.quant)(params), EngineConfig(slots=8, max_len=PROMPT + NEW))
    batch, _ = _rollouts(model, params, engine=engine)
    return model, params, batch, engine


STEP_LR, EPOCHS_LR = 1e-3, 3e-3
TBPO_STEPS = 6
EPOCHS = TrainConfig(num_minibatches=2, ppo_epochs=2, assert_aligned=True)


@pytest.fixture(scope="module")
def step(setup):
    """One update on the whole batch, single device, the default objective and train config: the
    trainer (its compiled programs reused) and the updated weights and metrics."""
    model, params, batch, _ = setup
    trainer = Trainer(model, ObjectiveConfig(), TrainConfig(), OptimizerConfig(learning_rate=STEP_LR))
    state, (m,) = trainer.train_on_rollouts(trainer.init_state(params), batch)
    return trainer, state.params, jax.device_get(m)


@pytest.fixture(scope="module")
def epochs(setup):
    """2 minibatches x 2 epochs of the default objective (old_logprobs=auto: the rollout's, checked
    bitwise by the first update), minibatches in row order: the trainer, the final state and the 4
    updates' metrics. Its trainer never scores old log-probs (one test asserts it never compiled
    that program)."""
    model, params, batch, _ = setup
    trainer = Trainer(model, ObjectiveConfig(), EPOCHS, OptimizerConfig(learning_rate=EPOCHS_LR))
    state, history = trainer.train_on_rollouts(trainer.init_state(params), batch)
    return trainer, state, jax.device_get(history)


@pytest.fixture(scope="module")
def micro_step(setup):
    """The ``step`` fixture's update accumulated over 4 micro-batches, aligned (raises if the
    forward's log-probs differ from the rollout's by a bit)."""
    model, params, batch, _ = setup
    train = TrainConfig(assert_aligned=True, micro_batches=4)
    trainer = Trainer(model, ObjectiveConfig(), train, OptimizerConfig(learning_rate=STEP_LR))
    state, history = trainer.train_on_rollouts(trainer.init_state(params), batch)  # raises if old != rollout
    return state, jax.device_get(history)


def test_aligned_old_logprobs_equal_rollout_and_one_update_is_unclipped(setup, micro_step):
    """The first update's forward, in 4 micro-batches, scores the rollout's log-probs bitwise."""
    _, params, _, _ = setup
    state, history = micro_step
    (m,) = history
    assert int(state.step) == 1 and float(m["skipped"]) == 0.0
    # the rollout batch's metrics: aligned, full-length responses, a near-uniform random policy
    assert float(m["mismatch_frac_bitwise_equal"]) == 1.0 and float(m["mismatch_max_abs_diff"]) == 0.0
    assert float(m["mismatch_kl_k3"]) == 0.0 and float(m["truncation_rate"]) == 1.0
    assert float(m["response_len_mean"]) == float(m["response_len_max"]) == NEW
    assert 0.9 * np.log(128) < float(m["policy_entropy"]) <= np.log(128)
    assert float(m["low_prob_token_frac"]) == 0.0 and float(m["repetition_frac"]) == 0.0
    assert float(m["clip_frac"]) == 0.0 and float(m["band_mask_frac"]) == 0.0 and float(m["ratio_max"]) == 1.0
    assert float(m["is_weight_mean"]) == 1.0 and float(m["grad_norm"]) > 0
    moved = jax.tree.map(lambda a, b: bool((np.asarray(a) != np.asarray(b)).any()), state.params, params)
    assert any(jax.tree.leaves(moved))


@pytest.mark.parametrize("mesh_cfg", [None, sharding.MeshConfig(data=2, fsdp=4)])
def test_scoring_in_chunks_changes_no_bit(setup, mesh_cfg):
    """Old log-probs and every rollout-batch metric scored in micro-batch chunks (2 on one device,
    2 of one sequence per device on 8) equal one whole-batch forward's bit for bit; on the mesh,
    every chunk's kernels run on each device's own rows, with no data moved between devices."""
    model, params, batch, _ = setup
    batch = batch.replace(truncated=(np.arange(len(batch.advantages)) % 3 == 0).astype(np.float32))
    mesh = None if mesh_cfg is None else sharding.make_mesh(mesh_cfg)
    p = params if mesh is None else jax.device_put(params, sharding.param_shardings(model, mesh))
    chunked = TrainConfig(num_minibatches=2)  # 2 chunks: as the recompute and KL tests score
    whole_trainer = Trainer(model, ObjectiveConfig(), TrainConfig(), OptimizerConfig(), mesh=mesh)
    whole, whole_metrics = whole_trainer.old_logprobs_and_metrics(p, whole_trainer.shard_batch(batch))
    trainer = Trainer(model, ObjectiveConfig(), chunked, OptimizerConfig(), mesh=mesh)
    sharded = trainer.shard_batch(batch)
    with trainer._context():  # compiled once: the program that runs is the one whose HLO is read
        scoring = trainer._old_logprobs.lower(p, sharded).compile()
        old, metrics = scoring(p, sharded)
    np.testing.assert_array_equal(old, whole)
    assert metrics.keys() == whole_metrics.keys() and "truncation_rate" in metrics
    for key in metrics:
        np.testing.assert_array_equal(metrics[key], whole_metrics[key], err_msg=key)
    if mesh is not None:
        hlo = scoring.as_text()
        _assert_kernels_on_local_rows(hlo, model.config, 1, batch)
        # the collectives are the forward's (weights gathered: once a pass, layer-major, or in the
        # layer loop; the embedding's lookup) and the metrics' sums, none the chunking's
        names = COLLECTIVE.findall(hlo)
        ok = ("/while/body/", "/reduce_", f"/{layer_major.GATHER_SCOPE}/", "/embed_tokens/")
        assert names and not [n for n in names if not any(k in n for k in ok)], names


@pytest.mark.slow
def test_cutting_the_padding_changes_no_old_logprob(setup, step):
    """The same rows padded 7 inputs longer than they need (the loop's batch before
    train.length_buckets cuts it): the old log-probs are bitwise the cut batch's, 0 on the extra
    padding; the update agrees to float rounding (the backward's sums over the length differ)."""
    _, params, batch, _ = setup
    trainer = step[0]
    extra = lambda v: np.pad(v, [(0, 0), (0, 7)]) if v.ndim == 2 else v
    longer = batch.map(extra)
    assert longer.tokens.shape[1] == batch.tokens.shape[1] + 7
    outs = []
    for b in (batch, longer):
        old = np.asarray(trainer.old_logprobs(params, trainer.shard_batch(b)))
        state, m = trainer.update(trainer.init_state(params), trainer.shard_batch(b.replace(old_logp=old)))
        outs.append((old, m, state.params))
    (old, m, p), (old_longer, m_longer, p_longer) = outs
    np.testing.assert_array_equal(old_longer[:, : old.shape[1]], old)
    assert np.all(old_longer[:, old.shape[1] :] == 0) and np.any(old != 0)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(m_longer[key], m[key], rtol=1e-5, err_msg=key)
    # Adam's first step is ~lr (1e-3) per weight, g / |g| amplifying the rounding of a near-zero
    # gradient: the two steps agree to 1% of it
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), p_longer, p)


def test_chunking_errors(setup):
    model, params, batch, _ = setup
    trainer = Trainer(model, ObjectiveConfig(), TrainConfig(num_minibatches=3), OptimizerConfig())
    with pytest.raises(ValueError, match="16 sequences does not split into .* = 3 micro-batches"):
        trainer.old_logprobs(params, trainer.shard_batch(batch))
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4))
    trainer = Trainer(model, ObjectiveConfig(), TrainConfig(num_minibatches=4), OptimizerConfig(), mesh=mesh)
    with pytest.raises(ValueError, match="micro-batches of 4 sequences .* do not split over the 8 devices"):
        trainer.old_logprobs(params, trainer.shard_batch(batch))


def test_nan_batch_is_skipped_without_touching_params(setup, step):
    _, params, batch, _ = setup
    trainer = step[0]
    state = trainer.init_state(params)
    bad = batch.replace(advantages=np.where(np.arange(len(batch.advantages)) == 3, np.nan, batch.advantages))
    state, (m,) = trainer.train_on_rollouts(state, bad)
    assert float(m["skipped"]) == 1.0 and int(state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, state.params, params)


def test_error_token_grad_share(setup, step):
    """GRPO without a mismatch correction never reads rollout_logp, so rewriting it flags sequences
    as low-probability without changing the loss: no flag -> share 0, every sequence -> exactly 1,
    half of them -> strictly between, while loss and gradient stay the same."""
    model, params, batch, _ = setup
    trainer = Trainer(
        model,
        ObjectiveConfig(name="grpo"),
        TrainConfig(error_token_grad_share=True),
        OptimizerConfig(learning_rate=STEP_LR),
    )
    old = np.asarray(step[0].old_logprobs(params, trainer.shard_batch(batch)))
    low = np.where(batch.mask > 0, np.log(1e-4), 0.0).astype(np.float32)
    half = np.arange(len(low))[:, None] % 2 == 0
    shares, norms = [], []
    for rollout_logp in (old, low, np.where(half, low, old)):
        mb = trainer.shard_batch(batch.replace(rollout_logp=rollout_logp, old_logp=old))
        _, m = trainer.update(trainer.init_state(params), mb)
        shares.append(float(m["error_grad_share"]))
        norms.append((float(m["loss"]), float(m["grad_norm"])))
    assert shares[0] == 0.0 and shares[1] == 1.0 and 0.1 < shares[2] < 0.95, shares
    assert norms[0] == norms[1] == norms[2]


def test_minibatches_move_the_policy_so_clip_and_band_act(epochs):
    _, state, history = epochs
    assert len(history) == 4 and int(state.step) == 4
    assert float(history[0]["ratio_max"]) == 1.0  # the first update sees the old policy
    assert max(float(m["clip_frac"]) + float(m["band_mask_frac"]) for m in history[1:]) > 0


def _recompute() -> TrainConfig:
    return dataclasses.replace(EPOCHS, old_logprobs="recompute")


def test_old_logprobs_from_the_rollout_skip_a_forward_and_change_no_update(setup, epochs):
    """Aligned, the rollout's log-probs are the old ones: taking them (auto, the ``epochs`` run)
    instead of scoring the batch again gives bitwise the same updates and the same alignment
    statistics, measured by the first update's forward over its minibatch; naive mode cannot take
    them."""
    model, params, batch, _ = setup
    scoring = Trainer(model, ObjectiveConfig(), _recompute(), OptimizerConfig(learning_rate=EPOCHS_LR))
    slow, slow_history = scoring.train_on_rollouts(scoring.init_state(params), batch)
    slow_history = jax.device_get(slow_history)
    skipping, fast, fast_history = epochs
    assert not scoring._old_from_rollout and skipping._old_from_rollout
    jax.tree.map(np.testing.assert_array_equal, slow.params, fast.params)
    for a, b in zip(slow_history, fast_history, strict=True):
        assert a.keys() == b.keys()
        per_minibatch = {"policy_entropy", "implausible_token_frac", "implausible_seq_frac"}
        for key in a.keys() - per_minibatch:
            assert a[key] == b[key], key
        assert float(b["mismatch_frac_bitwise_equal"]) == 1.0 and float(b["mismatch_kl_k3"]) == 0.0
        # the first update's minibatch (half the rows) against the whole batch's
        np.testing.assert_allclose(b["policy_entropy"], a["policy_entropy"], rtol=0.05)
    # no old-log-prob program ran for the batch: it was never compiled
    assert skipping._old_logprobs._cache_size() == 0 and scoring._old_logprobs._cache_size() == 1
    naive = dataclasses.replace(model, quant=dataclasses.replace(model.quant, mode="naive"))
    assert not Trainer(naive, ObjectiveConfig(), TrainConfig(), OptimizerConfig())._old_from_rollout
    with pytest.raises(ValueError, match="old_logprobs=rollout needs the rollout's forward"):
        Trainer(naive, ObjectiveConfig(), TrainConfig(old_logprobs="rollout"), OptimizerConfig())


@pytest.mark.slow
def test_a_stale_batch_trains_from_the_behaviour_or_the_proximal_policy(setup, epochs):
    """A batch the weights 4 updates old rolled out (asynchronous rollouts): with pi_old the
    behaviour policy (auto, aligned) the correction weight is exactly 1 and the drift shows as
    ``staleness_*``; ``behaviour_check`` at the frozen behaviour weights is bitwise aligned; with the
    proximal policy (recompute) the capped weight pi_prox / pi_behav carries the staleness."""
    model, params, batch, _ = setup
    behaviour, moved, _ = epochs
    frozen = _freezer(model.quant)(params)  # what the engine ran
    check = behaviour.behaviour_check(frozen, batch)
    assert check["mismatch_frac_bitwise_equal"] == 1.0 and check["mismatch_kl_k3"] == 0.0
    recompute = Trainer(model, ObjectiveConfig(), _recompute(), OptimizerConfig(learning_rate=EPOCHS_LR))
    for mode, trainer in (("auto", behaviour), ("recompute", recompute)):
        state = trainer.init_state(moved.params)
        _, history = trainer.train_on_rollouts(state, batch, np.random.default_rng(1), stale=True)
        first = jax.device_get(history[0])
        assert not any(k.startswith("mismatch_") for k in first)
        assert float(first["staleness_kl_k3"]) > 0 and float(first["staleness_frac_bitwise_equal"]) < 1
        if mode == "auto":  # pi_old = pi_behav = the rollout's log-probs: w == 1 exactly
            assert float(first["is_weight_mean"]) == 1.0
        else:  # pi_old = pi_prox, the moved weights: w = pi_prox / pi_behav, not 1
            assert float(first["is_weight_mean"]) != 1.0


def test_micro_batches_accumulate_to_the_same_gradient(step, micro_step):
    """TBPO (a mean over sequences): the update accumulated over 4 micro-batches of 4 sequences is
    the whole batch's, loss, gradient and update to float rounding; the rollout batch's metrics,
    the first update's forward among them, are the same bits (the kernels are row-invariant)."""
    _, params, whole = step
    state, (micro,) = micro_step
    assert whole.keys() == micro.keys()
    for key in ("loss", "grad_norm", "update_ratio", "policy_loss", "ratio_max", "is_weight_mean"):
        np.testing.assert_allclose(float(micro[key]), float(whole[key]), rtol=1e-4, atol=1e-7, err_msg=key)
    for key in ("policy_entropy", "mismatch_frac_bitwise_equal", "response_len_mean", "truncation_rate"):
        assert micro[key] == whole[key], key
    # Adam's first step is ~lr (1e-3) per weight, g / |g| amplifying the rounding of a near-zero
    # gradient: the two steps agree to 1% of it
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), state.params, params)


def test_micro_batches_token_mean_unequal_lengths(setup, step):
    """token_mean over responses of 1..6 tokens and an empty row: the gradient accumulated over 1 and
    4 micro-batches is the same (the token count is the minibatch's, not each micro-batch's; the
    loss-level test covers 1, 2 and 4 for every objective)."""
    model, params, batch, _ = setup
    lengths = np.arange(batch.num_rows) % 7  # 0 (empty) .. 6 tokens
    start = np.argmax(batch.mask > 0, axis=1)[:, None]
    cols = np.arange(batch.mask.shape[1])[None]
    mask = ((cols >= start) & (cols < start + lengths[:, None])).astype(np.float32)
    trainer = Trainer(model, ObjectiveConfig(name="grpo"), TrainConfig(), OptimizerConfig())
    old = np.asarray(step[0].old_logprobs(params, trainer.shard_batch(batch)))
    mb = trainer.shard_batch(batch.replace(mask=mask, old_logp=old * mask))
    norms = normalisers(mb, trainer.objective)
    grads = [
        jax.jit(accumulate, static_argnums=(0, 3))(trainer._grads, params, mb, parts, norms)[0][2]
        for parts in (1, 4)
    ]
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads[0]))
    for other in grads[1:]:
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * scale), grads[0], other
        )


def test_accumulate_traces_the_backward_once(setup):
    """The accumulator's shapes and the scan's body share one trace of the forward and backward
    (tracing it is seconds at real depth)."""
    model, params, batch, _ = setup
    trainer = Trainer(model, ObjectiveConfig(name="grpo"), TrainConfig(), OptimizerConfig())
    mb = trainer.shard_batch(batch.replace(old_logp=batch.rollout_logp))
    traces = []

    def grads(p, b, norms):
        traces.append(b.num_rows)
        return trainer._grads(p, b, norms)

    jax.eval_shape(lambda p, b: accumulate(grads, p, b, 2, normalisers(b, trainer.objective)), params, mb)
    assert traces == [batch.num_rows // 2]


def test_kl_to_the_initial_policy(setup, epochs):
    """kl_coef = 0 (the ``epochs`` run): no reference copy, no reference scoring, no KL metric.
    kl_coef > 0: the state keeps the initial weights, frozen; at them the k3 term and its gradient
    are exactly 0 (the first update is bitwise the kl_coef = 0 one), later updates see KL > 0, and
    the KL's gradient alone is 0 at the reference and, off it, descends back toward it."""
    model, params, batch, _ = setup
    plain, _, base = epochs
    assert plain.init_state(params).ref_params is None and plain._ref_logprobs is None
    assert "kl_ref" not in base[0]

    train = dataclasses.replace(EPOCHS, assert_aligned=False)  # the state moves off the rollout's
    kl = Trainer(model, ObjectiveConfig(kl_coef=0.5), train, OptimizerConfig(learning_rate=EPOCHS_LR))
    state = kl.init_state(params)
    at_init = kl.shard_batch(batch)
    ref = np.asarray(kl.ref_logprobs(state, at_init)) * batch.mask
    np.testing.assert_array_equal(ref, kl.old_logprobs(state.params, at_init))
    moved, history = kl.train_on_rollouts(state, batch)
    assert float(history[0]["kl_ref"]) == 0.0
    for key, value in base[0].items():
        np.testing.assert_array_equal(history[0][key], value, err_msg=key)
    assert all(float(m["kl_ref"]) > 0 for m in history[1:]), [float(m["kl_ref"]) for m in history]
    jax.tree.map(np.testing.assert_array_equal, moved.ref_params, params)

    # the KL term alone (zero advantages), a fresh optimizer on small steps: every update 0 at the
    # reference; off it, the first minibatch's KL falls from its first update to its second (in
    # the next epoch)
    zero = batch.replace(advantages=np.zeros_like(batch.advantages))
    pull = Trainer(model, ObjectiveConfig(kl_coef=0.5), train, OptimizerConfig(learning_rate=1e-4))
    _, at_ref = pull.train_on_rollouts(pull.init_state(params), zero)
    assert all(float(m["loss"]) == float(m["grad_norm"]) == 0.0 for m in at_ref)
    off = dataclasses.replace(pull.init_state(moved.params), ref_params=moved.ref_params)
    _, (before, _, after, _) = pull.train_on_rollouts(off, zero)
    assert float(before["grad_norm"]) > 0 and 0 < float(after["kl_ref"]) < float(before["kl_ref"])
    with pytest.raises(ValueError, match="no ref_logp"):
        pull.update(off, pull.shard_batch(zero.replace(old_logp=zero.rollout_logp)))


COLLECTIVE = re.compile(
    r"\b(?:all-to-all|collective-permute|all-gather|all-reduce)\([^\n]*?op_name=\"([^\"]+)\""
)
KERNEL_LOOP = re.compile(r"= \(s32\[\], (f32\[[\d,]+\])[^\n]*? while\(.*?op_name=\"([^\"]+)\"")


def _batch_ways(mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in dict(sharding.DEFAULT_RULES)["batch"]]))


def _assert_kernels_on_local_rows(hlo: str, config, local_seqs: int, batch) -> None:
    """Every kernel's row-block loop in the compiled (per-device) program sits under shard_map, and
    the loop carries of the fused per-token chains and the log-softmax are blocks of the *local*
    rows (sequences per device x length), per the kernels' own block rules."""
    loops = KERNEL_LOOP.findall(hlo)
    # the CPU kernels, and a layer's fused per-token chains
    kernel_jit = r"jit\((matmul|grouped_matmul|rms_norm|rope|logsumexp|attention)\)|_attention/"

    kernels = [(shape, name) for shape, name in loops if re.search(kernel_jit, name)]
    assert len(kernels) > 8 and all("shard_map/" in name for _, name in kernels), kernels
    rows = local_seqs * batch.tokens.shape[1]
    h, heads, blocks = config.hidden_size, config.num_attention_heads, lambda r, b: -(-r // b)
    lse_rows = rows_per_block(rowwise.default_block_v(config.vocab_size))
    fused = fused_block_rows(config)
    nb = blocks(rows, fused) + 1
    expected = {  # the fused loops' first carries: q [.., heads, D], the layer's output [.., H]
        r"pre_attention/shard_map/while$": f"f32[{nb},{fused},{heads},{config.head_dim}]",
        r"post_attention/shard_map/while$": f"f32[{nb},{fused},{h}]",
        r"jit\(logsumexp\)": f"f32[{blocks(rows, lse_rows) + 1},{lse_rows}]",
    }
    for key, shape in expected.items():
        got = {s for s, name in kernels if re.search(key, name)}
        assert got == {shape}, (key, got, shape)


@pytest.mark.parametrize(
    "mesh_cfg", [sharding.MeshConfig(data=2, fsdp=4), sharding.MeshConfig(data=2, fsdp=2, tensor=2)]
)
def test_sharded_step_equals_single_device(setup, step, mesh_cfg):
    """Equal to the single-device step, the old log-probs bitwise (the kernels run per device on
    local rows, each row's arithmetic independent of the others); the compiled sharded update (the
    executable that then runs) has its kernel loops inside shard_map on the local batch rows."""
    model, params, batch, _ = setup
    single, single_params, m = step
    results = [(single_params, m)]
    mesh = sharding.make_mesh(mesh_cfg)
    opt = OptimizerConfig(learning_rate=STEP_LR)
    trainer = Trainer(model, ObjectiveConfig(), TrainConfig(), opt, mesh=mesh)
    p = jax.device_put(params, sharding.param_shardings(model, mesh))
    old, rollout_metrics = trainer.old_logprobs_and_metrics(p, trainer.shard_batch(batch))
    np.testing.assert_array_equal(old, single.old_logprobs(params, single.shard_batch(batch)))
    assert float(rollout_metrics["mismatch_frac_bitwise_equal"]) == 1.0
    # a mean over sequences on several devices sums in another order: close, not bitwise
    np.testing.assert_allclose(
        float(rollout_metrics["policy_entropy"]), float(m["policy_entropy"]), rtol=1e-6
    )
    mb = trainer.shard_batch(batch.replace(old_logp=np.asarray(old)))
    with trainer._context():
        update = trainer._update.lower(trainer.init_state(p), mb).compile()
        state, m = update(trainer.init_state(p), mb)
    results.append((state.params, m))
    _assert_kernels_on_local_rows(
        update.as_text(), model.config, len(batch.advantages) // _batch_ways(mesh), batch
    )
    # the gradient must agree closely; Adam's first step is about lr * sign(grad), so the few
    # coordinates whose gradient is near zero may round either way: bound their share and size
    np.testing.assert_allclose(
        float(results[0][1]["grad_norm"]), float(results[1][1]["grad_norm"]), rtol=1e-5
    )
    pairs = zip(jax.tree.leaves(results[0][0]), jax.tree.leaves(results[1][0]), strict=True)
    diff = np.concatenate([np.abs(np.asarray(a) - np.asarray(b)).ravel() for a, b in pairs])
    assert np.mean(diff > 1e-6) < 1e-3 and diff.max() <= 2e-3, (np.mean(diff > 1e-6), diff.max())


def test_tbpo_steps_raise_the_reward(setup, epochs):
    """Rollouts and TBPO updates in turn (the ``epochs`` trainer, the module's engine) raise the
    reward of fresh rollouts clearly above the first batch's."""
    model, params, _, engine = setup
    trainer = epochs[0]
    state = trainer.init_state(params)
    rewards = []
    for i in range(TBPO_STEPS):
        batch, reward = _rollouts(model, state.params, seed=i, engine=engine)
        rewards.append(reward)
        state, _ = trainer.train_on_rollouts(state, batch)
    final = np.mean([_rollouts(model, state.params, seed=100 + s, engine=engine)[1] for s in range(2)])
    assert final > rewards[0] + 0.1, (rewards, final)


def test_config_errors():
    with pytest.raises(ValueError, match="optimizer.name"):
        OptimizerConfig(name="sgd")
    with pytest.raises(ValueError, match="train.num_minibatches"):
        TrainConfig(num_minibatches=0)
    with pytest.raises(ValueError, match="train.old_logprobs must be one of"):
        TrainConfig(old_logprobs="engine")
