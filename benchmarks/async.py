"""Synchronous against one-step-off asynchronous RL on fake CPU devices, interleaved round by round.

Three runs of the smoke loop per round, in this order, each in a fresh process (so no run inherits
another's compiled programs or warm caches), their first step (compilation) left out:

- ``sync``: every device rolls out, then every device trains (``rollout.async_steps=0``);
- ``async``: ``rollout.async_steps=1`` with ``rollout.devices=R`` decoding and the other N - R
  training, the two phases overlapped;
- ``async-sequential``: the same schedule with ``rollout.overlap=false``: each phase alone on its
  group, so its busy time is what it costs uncontended.

Printed per configuration: median step time, median rollout and training busy time, the overlap
fraction (seconds both phases ran / the shorter phase's), and the step-time ratios as measured here.
Fake CPU devices share this machine's 2 cores: two phases that overlap here compete for the same
cores, and more devices add per-device overhead, not compute, so neither ratio is what a pod sees.
Then projections, labelled as such, from the uncontended (``async-sequential``) phase times r and t
on their groups: the async step is max(r, t) plus the measured weight move; the sync step runs each
phase on all N devices, under two stated models of how a phase's time scales with its devices
(both perfectly; or decode latency-bound, flat, as memory-bound decode at small per-device batch
is, and training perfectly). One-step-off gains only where decoding does not speed up with devices
as much as training does.

    python benchmarks/async.py [--devices 8] [--rollout-devices 2] [--rounds 2] [--steps 6] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "loop_smoke.yaml"


def configs(rollout_devices: int) -> dict[str, list[str]]:
    groups = ["rollout.async_steps=1", f"rollout.devices={rollout_devices}"]
    return {"sync": [], "async": groups, "async-sequential": [*groups, "rollout.overlap=false"]}


def run(name: str, overrides: list[str], steps: int, devices: int, common: list[str]) -> list[dict]:
    """One fresh-process run; its steps' metrics after the first."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "qarl_jax.main", f"--config={SMOKE}", f"run.output_dir={out}"]
        cmd += [f"run.steps={steps}", "run.eval_every=0", "run.checkpoint_every=0", *common, *overrides]
        env = dict(
            os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu"
        )
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
        if done.returncode:
            raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
        lines = [json.loads(line) for line in pathlib.Path(out, "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "time/step_s" in m][1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rollout-devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", help="also write the figures here as JSON")
    args = parser.parse_args()
    # 24 rows a step split over the 6 training devices (and over 8 in the sync run)
    common = [
        "data.batch_size=6",
        "rollout.samples_per_prompt=4",
        "train.num_minibatches=1",
        "rollout.slots=24",
    ]
    steps: dict[str, list[dict]] = {name: [] for name in configs(args.rollout_devices)}
    for r in range(args.rounds):
        for name, overrides in configs(args.rollout_devices).items():
            got = run(name, overrides, args.steps, args.devices, common)
            steps[name] += got
            median = statistics.median(m["time/step_s"] for m in got)
            print(f"round {r + 1}/{args.rounds} {name}: {median:.3f} s/step", flush=True)
    med = lambda name, key: statistics.median(m[key] for m in steps[name])  # noqa: E731
    keys = ("time/step_s", "time/rollout_busy", "time/train_busy", "time/overlap_frac", "time/weight_sync")
    figures = {name: {k.removeprefix("time/"): med(name, k) for k in keys} for name in steps}
    split = f"{args.rollout_devices} decode, {args.devices - args.rollout_devices} train"
    print(f"\n{args.devices} fake CPU devices; async {split}; median of {args.rounds}x{args.steps - 1} steps")
    print(f"{'run':18s} {'step s':>8s} {'rollout s':>10s} {'train s':>8s} {'overlap':>8s}")
    for name, f in figures.items():
        busy = f"{f['rollout_busy']:10.3f} {f['train_busy']:8.3f}"
        print(f"{name:18s} {f['step_s']:8.3f} {busy} {f['overlap_frac']:8.2f}")
    n, r_dev = args.devices, args.rollout_devices
    seq = figures["async-sequential"]
    r, t, move = seq["rollout_busy"], seq["train_busy"], seq["weight_sync"]
    measured = {
        "async_over_sync": figures["async"]["step_s"] / figures["sync"]["step_s"],
        "async_over_async_sequential": figures["async"]["step_s"] / seq["step_s"],
    }
    print(
        f"measured here: async / sync step time {measured['async_over_sync']:.2f}, async / "
        f"async-sequential {measured['async_over_async_sequential']:.2f} (the overlapped phases share this "
        "machine's 2 cores, and fake devices add per-device overhead, not compute)"
    )
    # PROJECTIONS from the uncontended phase times r (on r_dev devices) and t (on n - r_dev): the sync
    # step runs each phase on all n devices; the async step is max(r, t) + the weight move
    async_step = max(r, t) + move
    models = {  # how a phase's time scales with its device count
        "both phases scale with devices": r * r_dev / n + t * (n - r_dev) / n,
        "decode latency-bound (time per token flat in devices), training scales": r + t * (n - r_dev) / n,
    }
    projected = {}
    for name, sync_step in models.items():
        projected[name] = sync_step / async_step
        print(
            f"PROJECTION, {name}: sync {sync_step:.3f} s vs async max(rollout {r:.3f}, train {t:.3f}) "
            f"+ move {move:.3f} = {async_step:.3f} s: {projected[name]:.2f}x"
        )
    if args.out:
        record = {"figures": figures, "measured": measured, "projected_gain": projected, "args": vars(args)}
        pathlib.Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
