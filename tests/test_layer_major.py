"""The forward-only pass in layer-major order (each layer's weights gathered once for every chunk of
rows) gives the chunk-major pass's log-probs and entropies bit for bit: dense and MoE, f32 master
weights with bf16 compute, quantized and not, scanned and unrolled layers, on an FSDP mesh whose
weights it must gather."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qarl_jax import quant, sharding
from qarl_jax.models import Qwen3ForCausalLM, init_params, preset
from qarl_jax.models.layer_major import merge_rows, split_rows
from qarl_jax.rl.logprobs import policy_logprobs_and_entropy, scores_by_chunks

ROWS, LENGTH, CHUNKS = 16, 12, 4


def _chunk_major(model, params, inputs, chunks):
    """The reference: the whole layer stack over one chunk after another."""

    def one(chunk):
        return policy_logprobs_and_entropy(model, params, *chunk, 1.0)

    logp, ent = jax.lax.map(one, tuple(split_rows(v, chunks) for v in inputs))
    return merge_rows(logp), merge_rows(ent)


def _inputs(vocab: int):
    """Packed rows: two sequences in some rows, padding (segment 0) at the ends of others."""
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, vocab, (ROWS, LENGTH)).astype(np.int32)
    cut = rng.randint(3, LENGTH - 2, ROWS)
    col = np.arange(LENGTH)[None, :]
    two = (np.arange(ROWS) % 2 == 0)[:, None]
    segment_ids = np.where(col < cut[:, None], 1, np.where(two, 2, 0)).astype(np.int32)
    positions = np.where(col < cut[:, None], col, np.where(two, col - cut[:, None], 0)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    return tuple(jnp.asarray(v) for v in (tokens, positions, segment_ids, targets))


@pytest.mark.parametrize(
    ("name", "fmt", "scan"),
    [("qwen3-tiny", "w4a16", True), ("qwen3-moe-tiny", "w8a8", True), ("qwen3-moe-tiny", None, False)],
)
def test_layer_major_pass_is_the_chunk_major_pass_bit_for_bit(name, fmt, scan):
    """Scanned, one body serves a stack's layers: 3 layers (the MoE's two runs: dense layer 0, a
    stack of 2). Unrolled, each layer is a copy of its kernels in both compiled programs (their
    compiles are the test's time): 2 layers, the MoE's dense layer 0 and an MoE layer."""
    layers = 3 if scan else 2
    config = preset(name, num_hidden_layers=layers, param_dtype="float32", dtype="bfloat16", scan_layers=scan)
    model = Qwen3ForCausalLM(config, None if fmt is None else quant.QuantSpec(fmt=fmt))
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4))
    # the master weights: the same bits as the quantized model's init, without its quantized forward
    params = init_params(Qwen3ForCausalLM(config), jax.random.key(1))
    params = jax.device_put(params, sharding.param_shardings(model, mesh))
    inputs = _inputs(config.vocab_size)
    with sharding.activate(mesh):
        inputs = tuple(jax.device_put(v, sharding.batch_sharding(mesh, 2)) for v in inputs)
        want = jax.jit(_chunk_major, static_argnums=(0, 3))(model, params, inputs, CHUNKS)
        got = jax.jit(lambda p, xs: scores_by_chunks(model, p, *xs, 1.0, chunks=CHUNKS, entropy=True))(
            params, inputs
        )
    for w, g in zip(want, got, strict=True):
        w, g = np.asarray(w), np.asarray(g)
        assert w.dtype == np.float32 and np.isfinite(w).all()
        np.testing.assert_array_equal(g, w)
