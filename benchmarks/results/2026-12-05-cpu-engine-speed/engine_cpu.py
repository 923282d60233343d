"""The CPU engine's tokens/s and CPU time in one tree (benchmarks/rollout.py's CPU shape and engine
runner: batch 32, prompt 32, 64 new tokens, greedy), one process per tree:
python engine_cpu.py TREE FMTS ROUNDS -> JSON {fmt: [median tokens/s wall, median CPU ms a rollout]}."""

import importlib.util
import json
import sys
import time


def main(tree: str, fmts: str, rounds: int) -> dict:
    sys.path.insert(0, tree)
    spec = importlib.util.spec_from_file_location("rollout_bench", f"{tree}/benchmarks/rollout.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import jax
    import numpy as np

    config_cls = getattr(mod, "TransformerConfig", None) or mod.Qwen3Config  # the name before 0e94f63
    config = config_cls(**mod.CPU_SHAPE)
    params = mod.init_params(mod.Qwen3ForCausalLM(config), jax.random.key(0))
    prompts = np.random.default_rng(0).integers(3, 500, (32, 32)).astype(np.int32)
    out = {}
    for fmt in fmts.split(","):
        run, _, _ = mod.engine_runner(config, params, fmt, prompts, 64)
        wall, cpu = [], []
        for _ in range(rounds):
            t, c = time.perf_counter(), time.process_time()
            run()
            wall.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        out[fmt] = [round(32 * 64 / float(np.median(wall)), 1), round(1000 * float(np.median(cpu)), 1)]
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
