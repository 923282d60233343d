"""Host RAM a pod host adds while loading a Hugging Face checkpoint, as a fraction of the f32 model.

Two JAX processes on this machine stand for two hosts (as ``tests/test_multihost.py``): each has
``--devices / 2`` CPU devices, the parameters are sharded fsdp over all of them, and each process
loads the same checkpoint with ``from_pretrained(..., shardings=...)`` (what ``build_policy`` does).
On CPU devices a host's shards live in its RAM, so the ideal is its share (1/2 of the f32 model)
plus the loader's working set. Each process resets its peak RSS (writing 5 to
``/proc/self/clear_refs`` resets ``VmHWM``), loads, and reports ``VmHWM - VmRSS before`` / f32 size.

The checkpoint is a random transformers ``Qwen3ForCausalLM`` (torch, f32; made once, kept in
``--dir``): vocab 16384, hidden 1024, MLP 3072, 16 layers, 16 heads (8 kv) of 64, untied head:
235M parameters, 0.94 GB f32.

    python benchmarks/host_ram.py [--dir /tmp/qarl_host_ram_ckpt] [--scan-layers] [--json OUT]

The package measured is the one ``PYTHONPATH`` puts first (run it with another checkout's root on
``PYTHONPATH`` to measure that one's loader).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys

SHAPE = dict(
    vocab_size=16384,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=False,
)


def make_checkpoint(out: pathlib.Path) -> None:
    """A random transformers Qwen3 in f32 at ``out`` (sharded safetensors with an index)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (out / "config.json").exists():
        return
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, dtype="float32")).to(torch.float32)
    model.save_pretrained(out, max_shard_size="300MB")


def status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child(ckpt: str, coordinator: str, process_id: int, scan_layers: bool) -> None:
    import jax

    jax.distributed.initialize(coordinator, 2, process_id)
    from qarl_jax import sharding
    from qarl_jax.models import Qwen3ForCausalLM, from_pretrained, init_params
    from qarl_jax.models.hf_io import load_config

    config = load_config(ckpt, scan_layers=scan_layers)
    model = Qwen3ForCausalLM(config)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=jax.device_count()))
    shardings = sharding.param_shardings(model, mesh)
    abstract = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    f32_bytes = sum(4 * x.size for x in jax.tree.leaves(abstract))
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    base = status("VmRSS")
    _, params, _ = from_pretrained(ckpt, shardings=shardings, scan_layers=scan_layers)
    jax.block_until_ready(params)
    added = status("VmHWM") - base
    held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    print(json.dumps(dict(process=process_id, added=added, f32_bytes=f32_bytes, held=held)), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/qarl_host_ram_ckpt")
    ap.add_argument("--devices", type=int, default=8, help="CPU devices over both processes")
    ap.add_argument("--scan-layers", action="store_true", help="load the stacked (scanned) layout")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]), args.scan_layers)
        return
    ckpt = pathlib.Path(args.dir)
    make_checkpoint(ckpt)
    coordinator = f"localhost:{free_port()}"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices // 2}",
    )
    argv = [sys.executable, __file__, "--child", str(ckpt), coordinator]
    scan = ["--scan-layers"] if args.scan_layers else []
    procs = [
        subprocess.Popen([*argv, str(i), *scan], env=env, stdout=subprocess.PIPE, text=True) for i in range(2)
    ]
    results = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            sys.exit(f"a loading process failed (exit {p.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        r["added_over_f32"] = round(r["added"] / r["f32_bytes"], 3)
        r["held_over_f32"] = round(r["held"] / r["f32_bytes"], 3)
    print(json.dumps(dict(checkpoint=str(ckpt), scan_layers=args.scan_layers, hosts=results), indent=2))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
