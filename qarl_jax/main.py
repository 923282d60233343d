"""``python -m qarl_jax.main [--config FILE.yaml] [key=value ...] [--export-hf DIR]``

Trains a policy with quantized rollouts (see :mod:`qarl_jax.train`). With no arguments: the
embedded default, a tiny Qwen3 policy on the synthetic arithmetic task with w4a16 rollouts, the
aligned training forward and TBPO, on whatever devices JAX finds. Rerunning the same command
resumes from the run directory's latest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys

from qarl_jax.checkpoint import CheckpointError
from qarl_jax.config import ConfigError, load_config
from qarl_jax.models import CheckpointError as ModelLoadError
from qarl_jax.models import save_pretrained
from qarl_jax.train import build_tokenizer, train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qarl_jax.main", description=__doc__.split("\n\n")[1])
    parser.add_argument("--config", help="YAML file of overrides (see configs/)")
    parser.add_argument("--export-hf", metavar="DIR", help="write the final policy here (save_pretrained)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.steps=20 quant.fmt=w8a8")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        result = train(config)
    except (CheckpointError, ModelLoadError) as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 3
    if args.export_hf:
        save_pretrained(args.export_hf, result.model.config, result.state.params, build_tokenizer(config))
    print(json.dumps(result.summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
