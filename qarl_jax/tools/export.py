"""``python -m qarl_jax.tools.export CHECKPOINT --out DIR [--hf]``

Writes the policy of a training run's checkpoint for serving: the run directory's newest intact
checkpoint, or one step of it (RUN/checkpoints/23). By default the deployed weights of the run's
quant.fmt as a compressed-tensors checkpoint, the integers and scales its rollouts ran (vLLM,
SGLang and transformers load it); with --hf the float master weights as a plain Hugging Face
directory. Either is what python -m qarl_jax.main writes at the end of a run with
--export-compressed-tensors or --export-hf, for a run that has already ended.

A run whose quant.fmt has no compressed-tensors scheme (bf16) is refused before anything loads,
naming the formats that have one; so is an output directory that cannot be written.

On several hosts (the multi-host flags, as python -m qarl_jax.main) every process runs it: each
tensor, one layer of a stacked leaf at a time, is gathered and process 0 writes it (local or gs://),
so no host holds the whole model (the bound: save_pretrained, save_compressed).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from qarl_jax import cli
from qarl_jax.errors import CheckpointError


def export_checkpoint(checkpoint: str | pathlib.Path, out: str | pathlib.Path, hf: bool = False) -> int:
    """Export ``checkpoint`` (a run directory or one of its steps) to ``out``: the deployed
    compressed-tensors checkpoint, or (``hf``) the master weights as Hugging Face safetensors.
    Returns the step exported."""
    from qarl_jax import storage
    from qarl_jax.config import load_config
    from qarl_jax.models.compressed_tensors import check_exportable
    from qarl_jax.run.build import build_tokenizer, restore_policy, run_checkpoint

    path = storage.parse(checkpoint, "CHECKPOINT")
    run = run_checkpoint(path)
    if run is None:
        raise CheckpointError(
            f"{path}: not a training run directory or one of its steps (RUN/checkpoints/N); a Hugging "
            "Face directory is already an export"
        )
    run_dir, step = run
    if not hf:
        check_exportable(load_config(run_dir / "config.json").quant)
    target = cli.writable_dir(out, "--out")  # local or gs://
    config, model, params, step = restore_policy(run_dir, step)
    tokenizer = build_tokenizer(config)
    # every process (collective): one tensor (one layer of a stack) gathered at a time, process 0 writes
    if hf:
        from qarl_jax.models import save_pretrained

        save_pretrained(target, model.config, params, tokenizer)
    else:
        import jax

        from qarl_jax.models.compressed_tensors import save_compressed
        from qarl_jax.rollout.layout import freeze

        # one compiled program, as the loop freezes (and as python -m qarl_jax.main exports)
        frozen = jax.jit(lambda p: freeze(p, config.quant, model))(params)
        save_compressed(target, model.config, frozen, config.quant, tokenizer)
    return step


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(
        prog="python -m qarl_jax.tools.export", description=cli.plain(__doc__.split("\n\n")[1])
    )
    parser.add_argument("checkpoint", help="a run directory or RUN/checkpoints/N (local or gs://)")
    parser.add_argument("--out", required=True, help="the directory to write (local or gs://)")
    parser.add_argument("--hf", action="store_true", help="the float master weights (as --export-hf)")
    cli.add_multihost(parser)
    args = parser.parse_args(argv)
    return cli.run(lambda: _export(args))


def _export(args: argparse.Namespace) -> int:
    from qarl_jax.run import distributed

    distributed.maybe_initialize(args.coordinator, args.num_processes, args.process_id, args.distributed)
    step = export_checkpoint(args.checkpoint, args.out, args.hf)
    kind = "Hugging Face (master weights)" if args.hf else "compressed-tensors (deployed weights)"
    print(f"wrote step {step} to {args.out} as {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
