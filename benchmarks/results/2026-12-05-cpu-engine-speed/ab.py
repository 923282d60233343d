"""Where the CPU engine's time went after issue 37, in one process: each variant patches one kernel
back (the rest is this tree's) and builds its own engine (benchmarks/rollout.py's CPU shape and
runner); the variants' rollouts then run interleaved ROUNDS times. Prints tokens/s and the median
per-round speed ratio to the first variant. Variants: main (this tree); rope_fused (RoPE fused into
the chain again, as before 26e3ece: not bitwise on f32 tensor layouts); rope_none (no RoPE: its
whole cost); attn_old (8dec0ef's attention kernel: not head-invariant).

    git show 8dec0ef:kernels_pallas/attention/cpu.py > /tmp/old_attention_cpu.py
    ROUNDS=30 python ab.py w8a8 main rope_fused rope_none attn_old
"""

import contextlib
import functools
import importlib.util
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../.."))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import kernels_pallas.attention.cpu as attention_cpu  # noqa: E402
import kernels_pallas.rowwise.cpu as rowwise_cpu  # noqa: E402
from kernels_pallas._rowblocks import map_row_blocks, row_kernel  # noqa: E402
from kernels_pallas._tiling import rows_per_block  # noqa: E402
from kernels_pallas.rowwise.reference import reference_rope  # noqa: E402


@functools.cache
def load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@row_kernel(static_argnames=("theta", "inv_freq", "block_rows"))
def rope_fused(x, positions, *, theta, inv_freq=None, block_rows=None):
    def block(xb, pb):
        return (reference_rope(xb, pb, theta, inv_freq),)

    rows = block_rows or rows_per_block(x.shape[1] * x.shape[2])
    out = jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return map_row_blocks(block, (x, positions), rows, (out,), fusable=True)[0]


def rope_none(x, positions, *, theta, inv_freq=None, block_rows=None):
    return x


PATCHES = {
    "main": {},
    "rope_fused": {(rowwise_cpu, "rope"): rope_fused},
    "rope_none": {(rowwise_cpu, "rope"): rope_none},
    "attn_old": {
        (attention_cpu, "attention"): lambda *a, **k: load("old", "/tmp/old_attention_cpu.py").attention(
            *a, **k
        )
    },
}


@contextlib.contextmanager
def patched(name: str):
    saved = {key: getattr(*key) for key in PATCHES[name]}
    for (module, attr), fn in PATCHES[name].items():
        setattr(module, attr, fn)
    try:
        yield
    finally:
        for (module, attr), fn in saved.items():
            setattr(module, attr, fn)


def main(fmt: str, variants: list[str], rounds: int) -> None:
    bench = load("rollout_bench", f"{ROOT}/benchmarks/rollout.py")
    config = bench.TransformerConfig(**bench.CPU_SHAPE)
    params = bench.init_params(bench.Qwen3ForCausalLM(config), jax.random.key(0))
    prompts = np.random.default_rng(0).integers(3, 500, (32, 32)).astype(np.int32)
    runs = {}
    for name in variants:
        with patched(name):  # the engine's programs are traced here, with the variant's kernel
            runs[name], _, _ = bench.engine_runner(config, params, fmt, prompts, 64)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name in variants:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    base = times[variants[0]]
    for name in variants:
        ratios = [b / t for b, t in zip(base, times[name], strict=True)]
        print(
            f"{fmt} {name}: {32 * 64 / np.median(times[name]):.0f} tokens/s, speed / {variants[0]}'s: "
            f"median {np.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:], int(os.environ.get("ROUNDS", 30)))
