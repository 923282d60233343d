"""GPU (Pallas-Triton) and TPU (Pallas Mosaic) row-wise and attention kernels, checked without either
device: lowering for the platform, and the same kernels in interpret mode against float64 references
and for invariance (a row's bits do not depend on the other rows; a token's attention output is the
same in a packed full-sequence call and in a decode step over a cache). Shapes are tiny: the
interpreters, the TPU one above all, are slow; a test's interpreted calls run as one program (see
pallas_cases), each its own kernel launch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pallas_cases import PLATFORM, lowered_text, one_program
from tiers import slow_but

from kernels_pallas import attention as attn
from kernels_pallas import rowwise

BACKENDS = ["gpu", "tpu"]
EPS, THETA, TEMP, BLOCK_V, BLOCK_KV = 1e-6, 10000.0, 0.7, 128, 16


def rand(shape, seed, scale=1.0, dtype=jnp.float32):
    return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


# ---- float64 references --------------------------------------------------------------------------


def rms_f64(x, w):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + EPS) * np.asarray(w, np.float64)


# precomputed inverse frequencies (a scaled RoPE's, e.g. Llama 3's: the low ones divided down)
SCALED = tuple(float(f) for f in (1.0 / THETA ** (np.arange(0, 16, 2) / 16) / [1, 1, 1, 1.5, 3, 8, 8, 8]))


def rope_f64(x, pos, inv_freq=None):
    """float64 rotation at the f32 angles the kernels compute (an f32 angle of ~700 is itself only
    good to ~3e-5, which is the model's numerics, not the kernel's error; the frequencies f64
    rounded to f32 once, as ``common.inv_freq``, not f32 ``power``, whose bits depend on the host's
    CPU, and a 1-ulp frequency at position ~700 moves a value by ~5e-6); ``inv_freq``: given
    frequencies instead of THETA's."""
    x, d = np.asarray(x, np.float64), x.shape[-1]
    inv = (1.0 / THETA ** (np.arange(0, d, 2) / d)).astype(np.float32)  # f64 rounded once, as the kernels
    inv = inv if inv_freq is None else np.asarray(inv_freq, np.float32)
    ang = (np.asarray(pos, np.float32)[:, None] * inv).astype(np.float64)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def lse_f64(x):
    z = np.asarray(x, np.float64) / TEMP
    mx = z.max(-1, keepdims=True)
    return (mx + np.log(np.exp(z - mx).sum(-1, keepdims=True)))[:, 0]


# ---- the calls, one per kernel -------------------------------------------------------------------

ROW_CASES = {  # (the call on a backend, in the interpreter or compiled for it; its inputs)
    "rms_norm": (
        lambda b, x, w, interpret=True: rowwise.rms_norm(x, w, EPS, backend=b, interpret=interpret),
        lambda: (rand((20, 96), 0), rand((96,), 1)),
    ),
    "rope": (
        lambda b, x, p, interpret=True: rowwise.rope(x, p, THETA, backend=b, interpret=interpret),
        lambda: (rand((20, 2, 16), 2), jnp.arange(20, dtype=jnp.int32) * 37),
    ),
    "rope_scaled": (
        lambda b, x, p, interpret=True: rowwise.rope(x, p, THETA, SCALED, backend=b, interpret=interpret),
        lambda: (rand((20, 2, 16), 6), jnp.arange(20, dtype=jnp.int32) * 37),
    ),
    "logsumexp": (
        lambda b, x, interpret=True, block_v=BLOCK_V: rowwise.logsumexp(
            x, TEMP, block_v=block_v, backend=b, interpret=interpret
        ),
        lambda: (rand((20, 300), 3, scale=4.0),),
    ),
}
F64 = {
    "rms_norm": rms_f64,
    "rope": rope_f64,
    "rope_scaled": lambda x, p: rope_f64(x, p, SCALED),
    "logsumexp": lse_f64,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(ROW_CASES))
def test_rowwise_lowers_for_platform(backend, name):
    call, make = ROW_CASES[name]
    kw = {"logsumexp": dict(block_v=64)}.get(name, {})
    args = tuple(a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in make())
    text = lowered_text(backend, lambda *a: call(backend, *a, interpret=False, **kw), *args)
    assert PLATFORM[backend][1] in text


@pytest.mark.parametrize("backend", BACKENDS)
def test_public_api_dispatches_to_the_backend_kernels(backend):
    """``backend='gpu'/'tpu'`` (what jax.default_backend() gives on those machines) runs the Pallas
    kernels: every row-wise entry point and attention lower to the platform's custom call."""
    x, w = rand((3, 2, 16), 4, dtype=jnp.bfloat16), rand((16,), 5)
    pos = jnp.arange(3, dtype=jnp.int32)

    def f(x, w, pos):
        y = rowwise.rms_norm(x, w, EPS, backend=backend)
        y = rowwise.rope(y, pos, THETA, backend=backend)
        a = attn.attention(y[None], y[None], y[None], pos[None], backend=backend)
        return rowwise.token_logprobs(a.reshape(3, 32), pos, TEMP, backend=backend)

    text = lowered_text(backend, f, x, w, pos)
    suffix = "_tpu" if backend == "tpu" else ""
    for kernel in ("rms_norm", "rope", "attention", "logsumexp"):
        assert f"qarl_{kernel}{suffix}" in text


@pytest.mark.parametrize("backend", slow_but(BACKENDS, "gpu"))
@pytest.mark.parametrize("name", list(ROW_CASES))
def test_rowwise_matches_f64_and_rows_are_invariant(backend, name):
    run, make = ROW_CASES[name]
    args = make()
    # one row alone (decode-sized call), and the same row among other neighbours at another index
    # (another row block)
    one = tuple(a[5:6] if i == 0 or name.startswith("rope") else a for i, a in enumerate(args))
    other = list(make())
    other[0] = rand(args[0].shape, 9, scale=4.0 if name == "logsumexp" else 1.0).at[17].set(args[0][5])
    if name.startswith("rope"):
        other[1] = (other[1] * 3).at[17].set(args[1][5])
    # the three calls, each its own kernel launch, in one program (see pallas_cases)
    full, one, other = one_program(lambda *calls: [run(backend, *a) for a in calls], args, one, tuple(other))
    np.testing.assert_allclose(full, F64[name](*args), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(one, full[5:6])
    np.testing.assert_array_equal(other[17], full[5])


# ---- attention -----------------------------------------------------------------------------------

H, KV, D = 4, 2, 16
LENS = (7, 26)  # two packed segments; the second spans two key blocks


def packed_inputs():
    t = sum(LENS)
    q, k, v = rand((1, t, H, D), 10), rand((1, t, KV, D), 11), rand((1, t, KV, D), 12)
    seg = jnp.asarray(np.repeat(np.arange(len(LENS)), LENS)[None], jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(n) for n in LENS])[None], jnp.int32)
    return q, k, v, pos, jnp.arange(t, dtype=jnp.int32)[None] - pos, seg


def attn_calls(backend, calls) -> list[np.ndarray]:
    """The interpreted attention kernel on each (block_kv, args) of ``calls``, in one program (see
    pallas_cases), each call its own kernel launch."""
    run = lambda bkv, args: attn.attention(*args, block_kv=bkv, backend=backend, interpret=True)
    return one_program(
        lambda *args: [run(bkv, a) for (bkv, _), a in zip(calls, args, strict=True)], *(a for _, a in calls)
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_lowers_for_platform(backend):
    q, k, v, pos, st, seg = packed_inputs()
    q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
    fn = lambda *a: attn.attention(*a, block_kv=BLOCK_KV, backend=backend)
    assert PLATFORM[backend][1] in lowered_text(backend, fn, q, k, v, pos, st, seg, seg)
    assert PLATFORM[backend][1] in lowered_text(backend, fn, q[:, :1], k, v, pos[:, :1])  # decode, no starts


@pytest.mark.parametrize("backend", slow_but(BACKENDS, "gpu"))
def test_attention_matches_f64_and_decode_equals_full_sequence(backend):
    q, k, v, pos, st, seg = packed_inputs()
    # decode over a cache: segment 1 in row 0 of a 40-slot cache (unwritten slots masked by -1),
    # an unrelated sequence in row 1; one query per row, at positions 20 and 3.
    s, (a, n) = 40, (LENS[0], LENS[1])

    def cache(x, other):
        c = np.zeros((2, s, KV, D), np.float32)
        c[0, :n], c[1, :n] = np.asarray(x)[0, a:], other
        return c

    kc, vc = cache(k, rand((n, KV, D), 13)), cache(v, rand((n, KV, D), 14))
    kseg = np.where(np.arange(s) < n, 0, -1)[None].repeat(2, 0).astype(np.int32)
    p = np.array([[20], [3]], np.int32)
    qd = np.concatenate([np.asarray(q)[:, a + 20 : a + 21], rand((1, 1, H, D), 15)])
    decode = (qd, kc, vc, p, None, np.zeros_like(p), kseg)
    # and with another key blocking (the negative control below)
    full, dec, dec32 = attn_calls(
        backend, [(BLOCK_KV, (q, k, v, pos, st, seg, seg)), (BLOCK_KV, decode), (32, decode)]
    )
    np.testing.assert_allclose(
        full, attn.reference_attention_f64(q, k, v, pos, st, seg, seg), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(dec[0, 0], full[0, a + 20])
    # negative control: another key blocking changes the summation order, and the bits show it
    assert not np.array_equal(dec32[0, 0], full[0, a + 20])
