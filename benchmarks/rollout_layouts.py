"""The rollout engine's own layouts on 8 fake CPU devices: what the per-step weight move costs, and
what computing every projection in column blocks (what a tensor-parallel rollout asks of the
training forward) costs the one-device CPU forward.

``sync``: the training loop's move: frozen weights quantized on an ``fsdp=8`` mesh, then moved into
the engine's layout (``rollout.mesh``) by ``WeightSync``; prints the frozen bytes, the bytes the
busiest device receives and the best of 4 quantize and move times (host copies between fake
devices: a count of bytes more than a speed).
``blocks``: the one-device decode step (8 slots) and a 256-token forward with ``tensor_blocks`` 1, 2
and 8, timed interleaved, median of 7, and their ratios to one block.

    python benchmarks/rollout_layouts.py sync [--preset P] [--layers N] [--layout data8|expert8|tensor8]
    python benchmarks/rollout_layouts.py blocks [--preset P] [--layers N]   (default qwen3-1.7b, 2 layers)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

LAYOUTS = {"data8": dict(data=8), "expert8": dict(data=1, expert=8), "tensor8": dict(data=1, tensor=8)}


def sync(preset_name: str, layers: int, name: str) -> None:
    import jax

    from qarl_jax import sharding
    from qarl_jax.models import Qwen3ForCausalLM, init_sharded, preset
    from qarl_jax.quant import QuantSpec
    from qarl_jax.rollout import layout

    extra = dict(tensor_blocks=8, dtype="bfloat16") if name == "tensor8" else {}
    config = preset(preset_name, num_hidden_layers=layers, scan_layers=True, **extra)
    model = Qwen3ForCausalLM(config, QuantSpec("w4a16"))
    train = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=8))
    with sharding.activate(train):
        params = init_sharded(model, jax.random.key(0), train)
        quantize = jax.jit(lambda p: layout.freeze(p, model.quant, model))
        frozen = quantize(params)
    engine = layout.engine_mesh(layout.RolloutMesh(**LAYOUTS[name]), jax.devices())
    move = layout.WeightSync(layout.frozen_shardings(model, frozen, engine))
    times = []
    for _ in range(4):
        with sharding.activate(train):
            start = time.perf_counter()
            fresh = jax.block_until_ready(quantize(params))
            quantized = time.perf_counter() - start
        del fresh  # the move below consumes a fresh copy each time
        with sharding.activate(train):
            moved = move(quantize(params), donate=True)
        times.append((quantized, move.seconds))
        del moved
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(frozen))
    print(
        f"{preset_name}, {layers} layers, fsdp=8 -> {name}: frozen {total / 1e9:.3f} GB, the busiest device "
        f"receives {move.bytes_per_device / 1e9:.3f} GB; quantize {min(t[0] for t in times):.3f} s, "
        f"move {min(t[1] for t in times):.3f} s (best of 4)"
    )


def blocks(preset_name: str, layers: int) -> None:
    import jax
    import jax.numpy as jnp

    from qarl_jax.models import KVCache, Qwen3ForCausalLM, init_params, preset
    from qarl_jax.quant import QuantSpec
    from qarl_jax.rollout import layout

    runs = {}
    one, position = jnp.zeros((8, 1), jnp.int32), jnp.full((8, 1), 100, jnp.int32)
    prompt = jnp.zeros((1, 256), jnp.int32)
    for t in (1, 2, 8):
        config = preset(
            preset_name, num_hidden_layers=layers, dtype="bfloat16", tensor_blocks=t, vocab_size=32768
        )
        model = Qwen3ForCausalLM(config, QuantSpec("w4a16"))
        params = layout.freeze(init_params(model, jax.random.key(0)), model.quant, model)
        cache = KVCache.init(config, 8, 512)
        decode = jax.jit(
            lambda p, tok, pos, c, m=model: m.apply({"params": p}, tok, pos, c, method="decode")[0]
        )
        forward = jax.jit(lambda p, tok, m=model: m.apply({"params": p}, tok))
        calls = {
            "decode": lambda d=decode, p=params, c=cache: d(p, one, position, c),
            "forward": lambda f=forward, p=params: f(p, prompt),
        }
        for call in calls.values():
            jax.block_until_ready(call())
        runs[t] = calls
    times = {t: {k: [] for k in calls} for t, calls in runs.items()}
    for _ in range(7):
        for t, calls in runs.items():
            for k, call in calls.items():
                start = time.perf_counter()
                jax.block_until_ready(call())
                times[t][k].append(time.perf_counter() - start)
    base = {k: statistics.median(v) for k, v in times[1].items()}
    for t in runs:
        med = {k: statistics.median(v) for k, v in times[t].items()}
        ratio = {k: med[k] / base[k] for k in med}
        print(
            f"tensor_blocks={t}: decode step {med['decode'] * 1e3:.1f} ms ({ratio['decode']:.2f}x), "
            f"256-token forward {med['forward'] * 1e3:.1f} ms ({ratio['forward']:.2f}x)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("sync", "blocks"))
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="data8")
    args = parser.parse_args(argv)
    if args.what == "sync":
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:  # XLA reads the flag at start-up
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
        sync(args.preset, args.layers, args.layout)
    else:
        blocks(args.preset, args.layers)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
