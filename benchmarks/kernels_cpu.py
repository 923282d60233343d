"""CPU speed of the batch-invariant row-block matmuls beside plain XLA ``jnp.dot``, and of the
invariant attention beside XLA's dense attention (``backend="xla"``), in one run.

Run: ``python benchmarks/kernels_cpu.py`` (small sizes, about 1 min). Plain XLA uses the dequantized
weight in the activation dtype: the speed a non-invariant path would have. Attention is timed in
CPU seconds of this process (all threads), interleaved A B A B, so a loaded machine moves both.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas as kp
from kernels_pallas.attention import attention as kp_attention

SHAPES = ((1, 512, 1536), (16, 512, 1536), (512, 512, 1536))  # (M, K, N)
REPEATS = 10
# (name, batch, queries per row, cache or row length): a Qwen3-1.7B layer's heads (16 / 8 KV x 128)
ATTENTION = (("decode, cache 512", 32, 1, 512), ("packed training rows", 4, 256, 256))


def _median_ms(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for m, k, n in SHAPES:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        xla = jax.jit(lambda x, w: jnp.dot(x, w))
        base = _median_ms(xla, x, w)
        for fmt in kp.FORMATS:
            wq = kp.quantize(w, fmt)
            ours = _median_ms(jax.jit(lambda x, wq: kp.quantized_matmul(x, wq, backend="cpu")), x, wq)
            rows.append((f"{m}x{k}x{n}", fmt, ours, base, ours / base))
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, f32 activations, median of {REPEATS}")
    print(f"| {'M x K x N':<14} | {'format':<6} | {'row-block ms':>12} | {'XLA dot ms':>10} | {'ratio':>6} |")
    print(f"| {'-' * 14} | {'-' * 6} | {'-' * 12} | {'-' * 10} | {'-' * 6} |")
    for shape, fmt, ours, base, ratio in rows:
        print(f"| {shape:<14} | {fmt:<6} | {ours:>12.3f} | {base:>10.3f} | {ratio:>6.2f} |")


def _cpu_ms(fn, args, n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return 1e3 * (time.process_time() - start) / n


def attention_table() -> None:
    """Invariant attention vs XLA's dense formula at decode and training shapes (CPU ms per call)."""
    rng = np.random.default_rng(0)
    print("| attention | invariant CPU ms | XLA dense CPU ms | ratio |")
    print("| --- | --- | --- | --- |")
    for name, b, t, s in ATTENTION:
        q = jnp.asarray(rng.standard_normal((b, t, 16, 128)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((b, s, 8, 128)), jnp.bfloat16) for _ in range(2))
        if t == 1:  # decode: each slot filled to a different length
            args = (q, k, v, jnp.asarray(rng.integers(100, 400, (b, 1)), jnp.int32))
        else:  # two packed sequences per row
            pos = np.concatenate([np.arange(100), np.arange(t - 100)])[None].repeat(b, 0)
            seg = np.concatenate([np.ones(100), 2 * np.ones(t - 100)]).astype(np.int32)[None].repeat(b, 0)
            starts = np.arange(t)[None] - pos
            args = (q, k, v, *(jnp.asarray(a, jnp.int32) for a in (pos, starts, seg, seg)))
        fns = [jax.jit(lambda *a, be=be: kp_attention(*a, backend=be)) for be in ("cpu", "xla")]
        for f in fns:
            jax.block_until_ready(f(*args))
        n = 10 if t == 1 else 2
        pairs = [[_cpu_ms(f, args, n) for f in fns] for _ in range(5)]
        ours, xla = (float(np.median([p[i] for p in pairs])) for i in (0, 1))
        ratio = float(np.median([p[0] / p[1] for p in pairs]))
        print(f"| {name} | {ours:.1f} | {xla:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
    attention_table()
