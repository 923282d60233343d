"""``python -m qarl_jax.main [--config FILE.yaml] [key=value ...] [--export-hf DIR] [multi-host flags]``

Trains a policy with quantized rollouts (see :mod:`qarl_jax.train`). With no arguments: the
embedded default, a tiny Qwen3 policy on the synthetic arithmetic task with w4a16 rollouts, the
aligned training forward and TBPO, on whatever devices JAX finds. Rerunning the same command
resumes from the run directory's latest checkpoint.

On N hosts, run the same command on each with ``--coordinator HOST:PORT --num-processes N
--process-id I`` (or $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID), or with
``--distributed`` where JAX detects the cluster itself (Cloud TPU, SLURM, ...); the run directory
must be the same (shared) path on every host. See :mod:`qarl_jax.distributed`.
"""

from __future__ import annotations

import argparse
import json
import sys

from qarl_jax import distributed
from qarl_jax.build import build_tokenizer
from qarl_jax.checkpoint import CheckpointError
from qarl_jax.config import ConfigError, load_config
from qarl_jax.models import save_pretrained
from qarl_jax.train import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qarl_jax.main", description=__doc__.split("\n\n")[1])
    parser.add_argument("--config", help="YAML file of overrides (see configs/)")
    parser.add_argument("--export-hf", metavar="DIR", help="write the final policy here (save_pretrained)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.steps=20 quant.fmt=w8a8")
    group = parser.add_argument_group("multi-host (jax.distributed; nothing to give on one host)")
    group.add_argument(
        "--coordinator", metavar="HOST:PORT", help="process 0's address, the same on every host"
    )
    group.add_argument("--num-processes", type=int, metavar="N", help="number of processes (hosts)")
    group.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0..N-1")
    group.add_argument(
        "--distributed", action="store_true", help="let JAX detect the cluster (Cloud TPU, ...)"
    )
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        distributed.maybe_initialize(args.coordinator, args.num_processes, args.process_id, args.distributed)
    except distributed.DistributedError as e:
        print(f"distributed error: {e}", file=sys.stderr)
        return 2
    try:
        result = train(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 3
    if args.export_hf:
        params = distributed.gather(result.state.params)  # every process: the whole weights
        if distributed.is_primary():
            save_pretrained(args.export_hf, result.model.config, params, build_tokenizer(config))
    print(json.dumps(result.summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
