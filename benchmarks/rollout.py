"""Rollout throughput: our engine against Hugging Face ``generate`` on the same weights and prompts.

CPU (default): a tiny Qwen3 (the 3.3M-param shape of the measurements' reference), batch 32, prompt
32, 64 new tokens, greedy, EOS ignored. The weights are exported with ``save_pretrained`` and loaded
by transformers (PyTorch, KV cache on); both run in one process, one after the other, and the
continuations are compared token for token (a difference only counts where the reference's top-2
logits are more than 1e-4 apart). Our engine runs the bf16 (unquantized) format, w8a8, w4a16 and fp8.

``--gpu-shape``: a Qwen3-1.7B-shaped model with random weights (bf16, lm_head unquantized), prompt
128, 256 new tokens, batch 16/64/256, per format, within ``--budget-s``; imports only jax, numpy,
flax and qarl_jax (no torch, transformers or TensorFlow there), plus aqtp, through
``quantize_params``, for the quantized formats (a pure-Python wheel on the H200). ``--small-sweep``
runs that sweep at the CPU shape (prompt 16, 16 new tokens) to prove it here. With ``--hf`` a sweep
times Hugging Face ``generate`` (PyTorch, on CUDA for ``--gpu-shape``) on a random-weight model of
the same shape and the same prompts instead of our engine: the outside reference. ``--json`` is
rewritten after every sweep cell, so a run killed at its time limit keeps the cells it finished.

    python benchmarks/rollout.py [--json OUT] [--gpu-shape | --small-sweep] [--hf] [--budget-s 400]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import jax
import numpy as np

import kernels_pallas
from qarl_jax import quant
from qarl_jax.cli import plain
from qarl_jax.models import PRESETS, Qwen3ForCausalLM, TransformerConfig, init_params, save_pretrained
from qarl_jax.models.hf_io import config_to_hf
from qarl_jax.rollout import GREEDY, EngineConfig, RolloutEngine, rollout

CPU_SHAPE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
)
GPU_SHAPE = {k: getattr(PRESETS["qwen3-1.7b"], k) for k in CPU_SHAPE}  # the same fields, Qwen3-1.7B
FORMATS = ("bf16", "w8a8", "w4a16", "fp8")
NAIVE_FORMATS = ("bf16", "w4a16")  # also run on XLA's own ops (backend "xla"), as the naive program
TIE_GAP = 1e-4


def engine_runner(config: TransformerConfig, params, fmt: str, prompts: np.ndarray, new: int, backend=None):
    """(run() -> tokens [B, new], compile+first-run seconds, quantize+engine-build seconds) of our
    engine in ``fmt``; ``backend`` "xla" traces it with XLA's own (non-invariant) ops instead of the
    invariant kernels."""
    setup = time.perf_counter()
    spec = quant.QuantSpec(fmt)
    model = Qwen3ForCausalLM(config, quant=spec)
    frozen = jax.block_until_ready(jax.jit(lambda p: quant.quantize_params(p, spec))(params))
    b, t = prompts.shape
    engine = RolloutEngine(
        model,
        frozen,
        EngineConfig(slots=b, max_len=t + new, prefill_buckets=(t,), max_prefill_batch=min(b, 32)),
    )

    def run():
        with kernels_pallas.default_backend(backend):  # read while the engine's calls are traced
            out = rollout(
                engine, prompts.tolist(), max_new_tokens=new, sampling=GREEDY, ignore_eos=True, progress=False
            )
        return np.asarray([s[0].tokens for s in out])

    start = time.perf_counter()
    setup = start - setup
    run()
    return run, time.perf_counter() - start, setup


def engine_run(config: TransformerConfig, params, fmt: str, prompts: np.ndarray, new: int, repeats: int):
    """(tokens [B, new], best tokens/s, compile+first-run seconds, quantize+engine-build seconds) of
    our engine in ``fmt``."""
    run, first, setup = engine_runner(config, params, fmt, prompts, new)
    best, tokens = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = run()
        best = min(best, time.perf_counter() - start)
    return tokens, prompts.shape[0] * new / best, first, setup


def hf_runner(path: str, prompts: np.ndarray, new: int):
    """(run() -> tokens [B, new], per-step top-2 logit gaps [B, new]) of transformers ``generate``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(2)  # as the reference measurement
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.as_tensor(prompts, dtype=torch.long)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True)
    with torch.no_grad():
        model.generate(x, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        scored = model.generate(x, **kw, output_logits=True, return_dict_in_generate=True)
    top2 = torch.stack(scored.logits, 1).float().topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).numpy()

    def run():
        with torch.no_grad():
            return model.generate(x, **kw)[:, prompts.shape[1] :].numpy()

    return run, gaps


def compare(ours: np.ndarray, ref: np.ndarray, gaps: np.ndarray) -> dict:
    """Rows equal, rows whose first difference is at a reference near-tie, and the others."""
    equal = tied = other = 0
    for row in range(ref.shape[0]):
        diff = np.flatnonzero(ours[row] != ref[row])
        if diff.size == 0:
            equal += 1
        elif gaps[row, diff[0]] <= TIE_GAP:
            tied += 1
        else:
            other += 1
    return {"rows_equal": equal, "rows_diverged_at_near_tie": tied, "rows_diverged_otherwise": other}


def cpu_benchmark(batch: int, prompt_len: int, new: int, rounds: int) -> dict:
    """HF ``generate`` and every engine, interleaved: each round runs each of them once, in the same
    order, so a machine that drifts (other load, clocks) cannot favour one side; each ratio is taken
    round by round and its median reported. The "xla" engines run XLA's own non-invariant ops (the
    naive program): ours / theirs is what the invariance costs."""
    config = TransformerConfig(**CPU_SHAPE)
    params = init_params(Qwen3ForCausalLM(config), jax.random.key(0))
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (batch, prompt_len)).astype(np.int32)
    with tempfile.TemporaryDirectory() as path:
        save_pretrained(path, config, params)
        hf, gaps = hf_runner(path, prompts, new)
    runners = {"hf": (hf, 0.0, 0.0)}
    for fmt in FORMATS:
        runners[fmt] = engine_runner(config, params, fmt, prompts, new)
    for fmt in NAIVE_FORMATS:
        runners[f"{fmt}/xla"] = engine_runner(config, params, fmt, prompts, new, backend="xla")
    seconds = {name: [] for name in runners}
    tokens = {}
    for _ in range(rounds):
        for name, (run, *_) in runners.items():
            start = time.perf_counter()
            tokens[name] = run()
            seconds[name].append(time.perf_counter() - start)
    hf_s = np.asarray(seconds["hf"])
    report = {
        "shape": "qwen3 3.3M (hidden 256, 4 layers, vocab 512)",
        "batch": batch,
        "prompt": prompt_len,
        "new_tokens": new,
        "rounds": rounds,
        "hf_generate_tokens_per_s": round(batch * new / float(np.median(hf_s)), 1),
    }
    for name in runners:
        if name == "hf":
            continue
        s = np.asarray(seconds[name])
        report[name] = {
            "tokens_per_s": round(batch * new / float(np.median(s)), 1),
            "speedup_vs_hf": round(float(np.median(hf_s / s)), 2),  # round by round
            "first_run_s": round(runners[name][1], 1),
            **compare(tokens[name], tokens["hf"], gaps),
        }
        fmt, _, naive = name.partition("/")
        if not naive and fmt in NAIVE_FORMATS:
            ratio = np.asarray(seconds[f"{fmt}/xla"]) / s
            report[name]["vs_naive_xla"] = round(float(np.median(ratio)), 2)  # < 1: invariance costs
        print(name, report[name], flush=True)
    return report


def _dump(report: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def sweep(
    shape: dict,
    batches: tuple[int, ...],
    prompt_len: int,
    new: int,
    budget_s: float,
    formats: tuple[str, ...],
    path: str | None,
) -> dict:
    """Our engine's tokens/s per batch (outer) and format (inner), starting no cell after ``budget_s``."""
    start = time.perf_counter()
    config = TransformerConfig(**shape, param_dtype="bfloat16", dtype="bfloat16")
    params = jax.block_until_ready(init_params(Qwen3ForCausalLM(config), jax.random.key(0)))
    report = {"shape": shape, "prompt": prompt_len, "new_tokens": new}
    report["init_s"] = round(time.perf_counter() - start, 1)
    rng = np.random.default_rng(0)
    for batch in batches:
        prompts = rng.integers(0, config.vocab_size, (batch, prompt_len)).astype(np.int32)
        for fmt in formats:
            if time.perf_counter() - start > budget_s:
                report.setdefault("skipped_over_budget", []).append(f"{fmt}@{batch}")
                continue
            _, tps, first, setup = engine_run(config, params, fmt, prompts, new, repeats=1)
            report[f"{fmt}@{batch}"] = {
                "tokens_per_s": round(tps, 1),
                "first_run_s": round(first, 1),
                "setup_s": round(setup, 1),
            }
            print(fmt, batch, report[f"{fmt}@{batch}"], flush=True)
            _dump(report, path)
    for batch in batches:
        bf16, w4 = report.get(f"bf16@{batch}"), report.get(f"w4a16@{batch}")
        if bf16 and w4:
            report[f"w4a16_over_bf16@{batch}"] = round(w4["tokens_per_s"] / bf16["tokens_per_s"], 2)
    return report


def hf_sweep(
    shape: dict,
    batches: tuple[int, ...],
    prompt_len: int,
    new: int,
    budget_s: float,
    device: str,
    path: str | None,
) -> dict:
    """Hugging Face ``generate`` (KV cache, greedy, never stopped by EOS) on a random-weight model of
    ``shape`` and the prompts :func:`sweep` draws; reports why it could not run instead of figures."""
    start = time.perf_counter()
    report: dict = {"reference": "transformers generate", "prompt": prompt_len, "new_tokens": new}
    try:
        import torch
        import transformers
    except ImportError as err:
        return report | {"unavailable": f"{type(err).__name__}: {err}"}
    if device == "cuda" and not torch.cuda.is_available():
        return report | {"unavailable": f"torch {torch.__version__} sees no CUDA device"}
    hf = config_to_hf(TransformerConfig(**shape))
    hf_config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
    report |= {"torch": torch.__version__, "transformers": transformers.__version__, "device": device}
    report |= {"dtype": str(dtype), "init_s": round(time.perf_counter() - start, 1)}
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    kw = dict(do_sample=False, use_cache=True)
    rng = np.random.default_rng(0)
    for batch in batches:
        x = torch.as_tensor(rng.integers(0, shape["vocab_size"], (batch, prompt_len)), device=device)
        if time.perf_counter() - start > budget_s:
            report.setdefault("skipped_over_budget", []).append(f"hf@{batch}")
            continue
        with torch.no_grad():
            t = time.perf_counter()
            model.generate(x, max_new_tokens=4, min_new_tokens=4, **kw)
            sync()
            warm = time.perf_counter() - t
            t = time.perf_counter()
            out = model.generate(x, max_new_tokens=new, min_new_tokens=new, **kw)
            sync()
            elapsed = time.perf_counter() - t
        generated = out.shape[1] - prompt_len
        if generated != new:
            raise RuntimeError(f"generate stopped after {generated} of {new} new tokens (EOS?)")
        report[f"hf@{batch}"] = {"tokens_per_s": round(batch * new / elapsed, 1), "warmup_s": round(warm, 1)}
        print("hf", batch, report[f"hf@{batch}"], flush=True)
        _dump(report, path)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=plain(__doc__.split("\n\n")[0]))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--gpu-shape", action="store_true", help="Qwen3-1.7B shape, batches 16/64/256")
    mode.add_argument("--small-sweep", action="store_true", help="the sweep at the CPU shape, 16+16 tokens")
    parser.add_argument("--hf", action="store_true", help="sweep: time HF generate instead of our engine")
    parser.add_argument("--budget-s", type=float, default=420.0, help="sweep: stop starting runs after this")
    parser.add_argument("--batches", default="16,64,256", help="sweep batch sizes")
    parser.add_argument("--formats", default=",".join(FORMATS), help="sweep: our engine's formats")
    parser.add_argument("--repeats", type=int, default=5, help="CPU mode: interleaved rounds (medians)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args(argv)
    if args.hf and not (args.gpu_shape or args.small_sweep):
        parser.error("--hf needs --gpu-shape or --small-sweep (the CPU mode already runs HF generate)")
    if args.gpu_shape or args.small_sweep:
        batches = tuple(int(b) for b in args.batches.split(","))
        shape, prompt, new = (GPU_SHAPE, 128, 256) if args.gpu_shape else (CPU_SHAPE, 16, 16)
        if args.hf:  # JAX's backend stays untouched: its GPU allocator would compete with torch's
            device = "cuda" if args.gpu_shape else "cpu"
            report = hf_sweep(shape, batches, prompt, new, args.budget_s, device, args.json)
        else:
            formats = tuple(args.formats.split(","))
            report = sweep(shape, batches, prompt, new, args.budget_s, formats, args.json)
    else:
        report = cpu_benchmark(32, 32, 64, args.repeats)
    if not args.hf:
        report |= {"backend": jax.default_backend(), "jax": jax.__version__}
    print(json.dumps(report, indent=2))
    _dump(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
