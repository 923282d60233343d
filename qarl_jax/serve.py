"""``python -m qarl_jax.serve --checkpoint DIR [--quant w4a16] [--port N] [--log-level LEVEL]``

Serves a Qwen3 checkpoint through the rollout engine with JetStream's orchestrator on a gRPC
server (JetStream's ``Orchestrator`` service, text or token-id prompts), bound to 127.0.0.1 unless
``--host`` says otherwise. Weights are frozen once into the quantized format, as for RL rollouts.

``--checkpoint`` takes a Hugging Face directory, a training run's directory (its newest intact
checkpoint) or one orbax step of it (``RUN/checkpoints/23``); a run's policy is exported to a
temporary Hugging Face directory first, as ``python -m qarl_jax.main --export-hf`` would write it.
A port already in use is refused before the model loads.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import pathlib
import socket
import sys
import tempfile

from kernels_pallas import FORMATS
from qarl_jax import cli, storage
from qarl_jax.errors import CheckpointError, ServeError
from qarl_jax.quiet_import import import_tensorflow

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def eos_ids(tokenizer, explicit: list[int] | None) -> tuple[int, ...]:
    """--eos-id values, else the ids of Qwen3's end tokens in the tokenizer."""
    if explicit:
        return tuple(explicit)
    ids = [tokenizer.token_to_id(t) for t in STOP_TOKENS] if tokenizer is not None else []
    found = tuple(i for i in ids if i is not None)
    if not found:
        raise CheckpointError(
            "no stop token: the checkpoint has no tokenizer with <|im_end|>/<|endoftext|>; pass --eos-id"
        )
    return found


def check_port(host: str, port: int) -> None:
    """Refuse a port something already listens on, before minutes of loading (SO_REUSEADDR only
    forgives closed connections in TIME_WAIT, never a live listener)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ServeError(
                f"cannot serve on {host}:{port}: {e.strerror} (another server there?); choose another --port"
            ) from None


def export_run(run_dir: pathlib.Path, step: int | None, out: pathlib.Path) -> int:
    """Write the policy of ``run_dir``'s checkpoint ``step`` (None: the newest intact) to ``out``
    as a Hugging Face directory; returns the step. The run's mesh is replaced by this host's devices."""
    from qarl_jax.models import save_pretrained
    from qarl_jax.run.build import build_tokenizer, restore_policy

    config, model, params, step = restore_policy(run_dir, step)
    save_pretrained(out, model.config, params, build_tokenizer(config))
    return step


def build_engine(args: argparse.Namespace, checkpoint: pathlib.Path):
    """(JetStreamEngine) from the command line; imports JetStream (TensorFlow: several seconds)."""
    import jax

    from qarl_jax import quant
    from qarl_jax.models import from_pretrained
    from qarl_jax.rollout import EngineConfig, RolloutEngine, SamplingParams
    from qarl_jax.rollout.jetstream_engine import JetStreamEngine

    spec = quant.QuantSpec(args.quant) if args.quant else None
    model, params, tokenizer = from_pretrained(checkpoint, dtype=args.dtype, quant=spec)
    frozen = jax.jit(lambda p: quant.quantize_params(p, spec))(params) if spec else params
    config = EngineConfig(slots=args.slots, max_len=args.max_len, eos_ids=eos_ids(tokenizer, args.eos_id))
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    return JetStreamEngine(RolloutEngine(model, frozen, config), tokenizer, sampling, args.seed)


def _parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(
        prog="python -m qarl_jax.serve", description=cli.plain(__doc__.split("\n\n")[1])
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a Hugging Face Qwen3 directory, a run directory or RUN/checkpoints/N",
    )
    parser.add_argument("--quant", choices=FORMATS, help="freeze weights into this format (default: none)")
    parser.add_argument("--port", type=cli.port, default=9000, help="0..65535; 0: any free port")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: localhost only)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--slots", type=cli.at_least(1), default=8, help="concurrent sequences")
    parser.add_argument(
        "--max-len", type=cli.at_least(2), default=1024, help="prompt + generated tokens per sequence"
    )
    parser.add_argument("--eos-id", type=cli.at_least(0), action="append", help="stop token id (repeatable)")
    parser.add_argument("--temperature", type=cli.at_least(0.0, float), default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=cli.at_least(0.0, float), default=1.0, help="in (0, 1]")
    parser.add_argument("--top-k", type=cli.at_least(0), default=0, help="0: off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=LOG_LEVELS,
        help="JetStream's logging (INFO: per-step logs; DEBUG: also TensorFlow's start-up lines)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not 0 < args.top_p <= 1:
        parser.error(f"argument --top-p: must be in (0, 1], got {args.top_p}")
    return cli.run(lambda: _serve(args))


def _serve(args: argparse.Namespace) -> int:
    check_port(args.host, args.port)
    path = storage.parse(args.checkpoint, "--checkpoint")  # local or gs://
    if not path.exists():
        raise CheckpointError(f"--checkpoint {path}: no such file or directory")
    from qarl_jax.run.build import is_hf_dir, run_checkpoint

    with contextlib.ExitStack() as stack:
        if not is_hf_dir(path):
            run = run_checkpoint(path)
            if run is None:
                raise CheckpointError(
                    f"--checkpoint {path}: neither a Hugging Face model directory (config.json + "
                    "safetensors) nor a training run directory; export a run with `python -m "
                    "qarl_jax.main ... --export-hf DIR`, or pass the run directory"
                )
            print(f"exporting the policy of {run[0]} to serve it", file=sys.stderr, flush=True)
            export = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="qarl-serve-")))
            step = export_run(*run, export)
            print(f"serving {run[0]}, checkpoint {step}", file=sys.stderr, flush=True)
            path = export
        # TensorFlow's start-up lines only at DEBUG; the orchestrator sets the root logger to DEBUG
        # when imported: import it, then set the level
        import_tensorflow(show=args.log_level == "DEBUG")
        from qarl_jax.rollout.jetstream_engine import Server, quiet_orchestrator_logs

        quiet_orchestrator_logs(getattr(logging, args.log_level))
        try:
            engine = build_engine(args, path)
        except ValueError as e:  # a model the engine cannot run
            raise CheckpointError(f"--checkpoint {args.checkpoint}: {e}") from e
    try:
        server = Server(engine, port=args.port, host=args.host)
    except OSError as e:  # the port taken while the model loaded: an address fault, not a file's
        raise ServeError(f"cannot serve on {args.host}:{args.port}: {e}; choose another --port") from e
    print(f"serving on {server.address}", flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
