"""``python -m qarl_jax.main [--config FILE.yaml] [key=value ...] [--export-hf DIR]
[--export-compressed-tensors DIR] [--print-config] [multi-host flags]``

Trains a policy with quantized rollouts (see :mod:`qarl_jax.run.train`). With no arguments: the
embedded default, a tiny Qwen3 policy on the synthetic arithmetic task with w4a16 rollouts, the
aligned training forward and TBPO, on whatever devices JAX finds. Rerunning the same command
resumes from the run directory's latest checkpoint.

On N hosts, run the same command on each with ``--coordinator HOST:PORT --num-processes N
--process-id I`` (or $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID), or with
``--distributed`` where JAX detects the cluster itself (SLURM, ...); on a multi-host Cloud TPU slice
the hosts are detected without a flag. The run directory must be one that every host reaches (a
bucket, a shared filesystem): hosts that do not share it are refused before any work (exit 7). A
SIGTERM on any host stops every process after the same step, saved (exit 75). See
:mod:`qarl_jax.run.distributed`, :mod:`qarl_jax.run.hosts`, :mod:`qarl_jax.run.preemption`.

Every error a user can cause ends the command with one line on stderr and a non-zero exit code,
the same in every command (:data:`qarl_jax.cli.EXIT_CODES`: 2 usage or config, 3 checkpoint, 4
data, 5 output, 6 grader, 7 hosts apart, 75 preempted, 130 Ctrl-C).

On Linux with glibc the command first re-executes itself once with malloc thresholds that keep
XLA:CPU's per-call temporaries in the heap (:mod:`qarl_jax.run.heap`; a ``GLIBC_TUNABLES`` of your own
that sets any ``glibc.malloc`` tunable is kept instead).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from qarl_jax import cli

EPILOG = (
    "Config keys: `python -m qarl_jax.main --print-config` prints every key with its value (defaults, "
    "then --config, then the overrides); any of them can be given as key=value."
)


def _parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(
        prog="python -m qarl_jax.main", description=cli.plain(__doc__.split("\n\n")[1]), epilog=EPILOG
    )
    parser.add_argument("--config", help="YAML file of overrides (see configs/)")
    parser.add_argument("--export-hf", metavar="DIR", help="write the final policy here (save_pretrained)")
    parser.add_argument(
        "--export-compressed-tensors",
        metavar="DIR",
        help="write the final policy's deployed quant.fmt weights here: the rollout's integers and "
        "scales as a compressed-tensors checkpoint (vLLM, SGLang, transformers load it)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the full resolved config as YAML and exit"
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. run.steps=20 quant.fmt=w8a8")
    group = parser.add_argument_group("multi-host (jax.distributed; nothing to give on one host)")
    group.add_argument(
        "--coordinator", metavar="HOST:PORT", help="process 0's address, the same on every host"
    )
    group.add_argument(
        "--num-processes", type=cli.at_least(1), metavar="N", help="number of processes (hosts)"
    )
    group.add_argument("--process-id", type=cli.at_least(0), metavar="I", help="this process's index, 0..N-1")
    group.add_argument(
        "--distributed",
        action="store_true",
        help="let JAX detect the cluster (SLURM, ...; a multi-host Cloud TPU slice is detected without it)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    if not args.print_config:
        print("qarl: starting (importing JAX and the model code)", file=sys.stderr, flush=True)
    return cli.run(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    import yaml

    from qarl_jax.config import load_config, to_dict
    from qarl_jax.run import distributed

    config = load_config(args.config, args.overrides)
    if args.print_config:
        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        return 0
    export_hf = export_ct = None  # local or gs:// (qarl_jax.storage), checked before the run, not after it
    if args.export_hf:
        export_hf = cli.writable_dir(args.export_hf, "--export-hf")
    if args.export_compressed_tensors:
        from qarl_jax.models.compressed_tensors import check_exportable

        check_exportable(config.quant)
        export_ct = cli.writable_dir(args.export_compressed_tensors, "--export-compressed-tensors")
    _compilation_cache(config.run.compilation_cache_dir)
    distributed.maybe_initialize(args.coordinator, args.num_processes, args.process_id, args.distributed)
    from qarl_jax.models import save_pretrained
    from qarl_jax.run.build import build_tokenizer
    from qarl_jax.run.train import train

    result = train(config)
    if export_hf is not None:
        # every process (collective): one tensor gathered at a time, process 0 writes (local or gs://)
        save_pretrained(export_hf, result.model.config, result.state.params, build_tokenizer(config))
    if export_ct is not None:
        import jax

        from qarl_jax.models.compressed_tensors import save_compressed
        from qarl_jax.rollout.layout import freeze

        # every process (collective): one frozen tensor gathered at a time, process 0 writes. Jitted
        # as the loop's own freeze is: its compiled program (op by op: ~80 programs, ~3 s of CPU on
        # the smoke model), and the weights the engine ran
        frozen = jax.jit(lambda p: freeze(p, config.quant, result.model))(result.state.params)
        save_compressed(export_ct, result.model.config, frozen, config.quant, build_tokenizer(config))
    print(json.dumps(result.summary, indent=2))
    return 0


COMPILATION_CACHE_BYTES = 4 << 30


def _compilation_cache(directory: str | None) -> None:
    """XLA's persistent cache in ``directory`` (run.compilation_cache_dir), unless JAX's own setting
    ($JAX_COMPILATION_CACHE_DIR) already names one. Programs that compile in under a second are not
    stored (JAX's threshold): the cache holds the step, rollout and eval programs. Bounded (least
    recently used entries go past 4 GiB), which also makes JAX lock the directory: runs sharing it
    never read an entry another is still writing."""
    import jax

    option = lambda name: getattr(jax.config, name)  # JAX's options are untyped dynamic attributes
    if directory and not option("jax_compilation_cache_dir"):
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
        if option("jax_compilation_cache_max_size") == -1:  # JAX's default: unbounded, unlocked
            jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)


if __name__ == "__main__":
    from qarl_jax.run.heap import reexec_with_tunables

    reexec_with_tunables()  # XLA:CPU's temporaries kept in the heap (see qarl_jax.run.heap)
    sys.exit(main())
