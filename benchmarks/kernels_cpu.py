"""CPU speed of the batch-invariant row-block matmuls beside plain XLA ``jnp.dot`` (one run, one table).

Run: ``python benchmarks/kernels_cpu.py`` (small sizes, < 1 min). Plain XLA uses the dequantized
weight in the activation dtype: the speed a non-invariant path would have.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import kernels_pallas as kp

SHAPES = ((1, 512, 1536), (16, 512, 1536), (512, 512, 1536))  # (M, K, N)
REPEATS = 10


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


if __name__ == "__main__":
    main()
