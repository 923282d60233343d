"""Zero-mismatch evidence on the accelerator: rollout log-probs (KV-cache decode, frozen quantized
weights) against the training forward (master weights, packed rows, another batch size), bitwise.

Run on the H200 (< 2 min):   PYTHONUNBUFFERED=1 python benchmarks/gpu_alignment_check.py
Runs here too (CPU path):    python benchmarks/gpu_alignment_check.py --new-tokens 6

For qwen3-tiny and qwen3-moe-tiny x {bf16, w8a8, w4a16}: 4 slots with prompts of 3..11 tokens,
sampled tokens, then the same sequences packed into 2 rows and scored by ``policy_logprobs``.
Prints one JSON line per cell (frac_bitwise_equal, max_abs_logp_diff, and the naive mode's figures)
and writes them to $OUT/gpu_alignment.json. Imports jax, numpy, flax, safetensors and qarl_jax, and
aqtp (AQT quantizes the weights) once a quantized format runs: carry it as a wheel on the H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from qarl_jax.models import Qwen3ForCausalLM, init_params, preset  # noqa: E402
from qarl_jax.quant import QuantSpec, quantize_params  # noqa: E402
from qarl_jax.rl.alignment import generated_logprobs, pack, rollout  # noqa: E402
from qarl_jax.rl.logprobs import policy_logprobs  # noqa: E402

PROMPT_LENS = (3, 11, 6, 8)


def check(name: str, fmt: str, new_tokens: int) -> dict:
    start = time.perf_counter()
    model = Qwen3ForCausalLM(preset(name), QuantSpec(fmt))
    params = init_params(model, jax.random.key(0))
    frozen = quantize_params(params, model.quant)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(0, model.config.vocab_size, n).astype(np.int32) for n in PROMPT_LENS]
    out = rollout(model, frozen, prompts, new_tokens, seed=2, max_len=64)
    seqs, roll = [s for s, _ in out], np.concatenate([lp for _, lp in out])
    length = sum(len(s) - 1 for s in seqs) // 2 + max(len(s) for s in seqs)
    batch = pack(seqs, 2, length)
    args = [jnp.asarray(batch[k]) for k in ("tokens", "positions", "segment_ids", "targets")]
    result = {"model": name, "format": fmt, "n_tokens": int(roll.size)}
    for mode in ("aligned", "naive"):
        m = model.clone(quant=dataclasses.replace(model.quant, mode=mode))
        logp = jax.jit(lambda p, *a, m=m: policy_logprobs(m, p, *a))(params, *args)
        train = np.concatenate(generated_logprobs(np.asarray(logp), batch, prompts, seqs))
        diff = np.abs(train - roll)
        result[f"{mode}_frac_bitwise_equal"] = float(np.mean(diff == 0))
        result[f"{mode}_max_abs_logp_diff"] = float(diff.max())
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    out_dir = pathlib.Path(os.environ.get("OUT", "./out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(
        json.dumps({"backend": jax.default_backend(), "jax": jax.__version__, "devices": str(jax.devices())})
    )
    results = []
    for name in ("qwen3-tiny", "qwen3-moe-tiny"):
        for fmt in ("bf16", "w8a8", "w4a16"):
            try:
                results.append(check(name, fmt, args.new_tokens))
            except Exception as err:  # keep going: one failing cell must not hide the others
                results.append({"model": name, "format": fmt, "error": f"{type(err).__name__}: {err}"[:2000]})
            print(json.dumps(results[-1]), flush=True)
            (out_dir / "gpu_alignment.json").write_text(json.dumps(results, indent=1))
    ok = all(r.get("aligned_frac_bitwise_equal") == 1.0 for r in results)
    print("ALL ALIGNED CELLS BITWISE EQUAL" if ok else "MISMATCH OR ERROR IN SOME CELL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
