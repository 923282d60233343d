"""``python -m qarl_jax.serve --checkpoint DIR [--quant w4a16] [--port N]``

Serves a Qwen3 checkpoint through the rollout engine with JetStream's orchestrator on a gRPC
server (JetStream's ``Orchestrator`` service, text or token-id prompts), bound to 127.0.0.1 unless
``--host`` says otherwise. Weights are frozen once into the quantized format, as for RL rollouts.
"""

from __future__ import annotations

import argparse
import sys

import jax

from kernels_pallas import FORMATS
from qarl_jax import quant
from qarl_jax.models import CheckpointError, from_pretrained
from qarl_jax.rollout import EngineConfig, RolloutEngine, SamplingParams

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def eos_ids(tokenizer, explicit: list[int] | None) -> tuple[int, ...]:
    """--eos-id values, else the ids of Qwen3's end tokens in the tokenizer."""
    if explicit:
        return tuple(explicit)
    found = [tokenizer.token_to_id(t) for t in STOP_TOKENS] if tokenizer is not None else []
    found = tuple(i for i in found if i is not None)
    if not found:
        raise ValueError(
            "no stop token: the checkpoint has no tokenizer with <|im_end|>/<|endoftext|>; pass --eos-id"
        )
    return found


def build_engine(args: argparse.Namespace):
    """(JetStreamEngine) from the command line; imports JetStream (TensorFlow: several seconds)."""
    from qarl_jax.rollout.jetstream_engine import JetStreamEngine

    spec = quant.QuantSpec(args.quant) if args.quant else None
    model, params, tokenizer = from_pretrained(args.checkpoint, dtype=args.dtype, quant=spec)
    frozen = jax.jit(lambda p: quant.quantize_params(p, spec))(params) if spec else params
    config = EngineConfig(slots=args.slots, max_len=args.max_len, eos_ids=eos_ids(tokenizer, args.eos_id))
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k)
    return JetStreamEngine(RolloutEngine(model, frozen, config), tokenizer, sampling, args.seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qarl_jax.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a local Hugging Face Qwen3 directory")
    parser.add_argument("--quant", choices=FORMATS, help="freeze weights into this format (default: none)")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: localhost only)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--slots", type=int, default=8, help="concurrent sequences")
    parser.add_argument("--max-len", type=int, default=1024, help="prompt + generated tokens per sequence")
    parser.add_argument("--eos-id", type=int, action="append", help="stop token id (repeatable)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="keep JetStream's per-step logs")
    args = parser.parse_args(argv)
    try:
        engine = build_engine(args)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from qarl_jax.rollout.jetstream_engine import Server, quiet_orchestrator_logs

    if not args.verbose:
        quiet_orchestrator_logs()
    server = Server(engine, port=args.port, host=args.host)
    print(f"serving on {server.address}", flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
