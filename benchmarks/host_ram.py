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
                                  [--export [--out /tmp/qarl_host_ram_export]]

``--export``: after loading, each process resets its peak again and runs the two exports in turn,
each measured on its own: ``save_pretrained`` of the params, then ``save_compressed`` of their
w4a16 freeze (``freeze`` as ``qarl_jax.main`` calls it, outside the measurement: it holds the frozen
model on the devices, not the export). Both are collective (every process gathers one tensor at a
time, process 0 writes), with ``max_shard_bytes`` = 256 MiB (``--max-shard-mib``): the stated
bound is one layer's leaf (on the devices; on process 0 once more in RAM) plus a 64 MiB copy piece
(the writer spools each tensor to local disk). Then both exports
are loaded with ``transformers.AutoModelForCausalLM.from_pretrained`` and a few of their tensors
compared with the params / the frozen weights dequantized (gathered after the measurements).
The peak of gathering the largest tensor (the embedding) alone is reported too: ``host_array``
holds it once across the host's devices and once in RAM, and on CPU devices both are host RAM
(on an accelerator the first is device memory), so about twice the tensor is the CPU stand-in's
floor. Before each measurement the process returns its freed heap to the system
(``malloc_trim``), so that memory an earlier step freed does not hide a peak.

The package measured is the one ``PYTHONPATH`` puts first (run it with another checkout's root on
``PYTHONPATH`` to measure that one's loader).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import pathlib
import shutil
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


CHECKED = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight")
CHECKED_QUANTIZED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.15.mlp.down_proj.weight")


def peak(fn):
    """``fn()`` and the peak RSS it added (bytes): freed heap returned first (``malloc_trim``, the
    module docstring), then the peak reset (``clear_refs``)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    base = status("VmRSS")
    out = fn()
    return out, status("VmHWM") - base


def export(out: pathlib.Path, config, model, params, max_shard_bytes: int) -> dict:
    """The two exports' added peaks (module docstring), then the :data:`CHECKED` tensors gathered
    (collective) and saved by process 0 for the parent to compare with the transformers load."""
    import jax
    import numpy as np

    from kernels_pallas.formats import QuantizedWeight, dequantize
    from qarl_jax.models import save_pretrained
    from qarl_jax.models.compressed_tensors import save_compressed
    from qarl_jax.models.safetensors_io import host_array, is_kernel, param_location, tensor_layout
    from qarl_jax.quant.spec import QuantSpec
    from qarl_jax.rollout.layout import freeze

    # the floor of any gather on CPU devices: the largest tensor (the embedding) gathered alone
    _, gather = peak(lambda: host_array(params["embed_tokens"]["embedding"]))
    _, hf = peak(lambda: save_pretrained(out / "hf", config, params, None, max_shard_bytes=max_shard_bytes))
    spec = QuantSpec(fmt="w4a16")
    frozen = jax.block_until_ready(freeze(params, spec, model))
    frozen_held = sum(s.data.nbytes for x in jax.tree.leaves(frozen) for s in x.addressable_shards)
    _, ct = peak(lambda: save_compressed(out / "ct", config, frozen, spec, max_shard_bytes=max_shard_bytes))
    checked, dequantized = {}, {}
    for path, name, _ in tensor_layout(config):
        if name in CHECKED or name in CHECKED_QUANTIZED:
            key, index = param_location(config, path)
            for tree, into in ((params, checked), (frozen, dequantized)):
                node = tree
                for k in key:
                    node = node[k]
                host = jax.tree.map(lambda a, i=index: host_array(a if i is None else a[i]), node)
                if isinstance(host, QuantizedWeight):
                    host = np.asarray(dequantize(host))
                into[name] = host.T if is_kernel(path) else host
    if jax.process_index() == 0:
        np.savez(out / "checked.npz", **{n: checked[n] for n in CHECKED})
        np.savez(out / "dequantized.npz", **{n: dequantized[n] for n in CHECKED_QUANTIZED})
    return dict(gather_embedding=gather, export_hf=hf, export_compressed=ct, frozen_held=frozen_held)


def child(ckpt: str, coordinator: str, process_id: int, scan_layers: bool, out: str | None, shard: int):
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

    def load():
        model, params, _ = from_pretrained(ckpt, shardings=shardings, scan_layers=scan_layers)
        return model, jax.block_until_ready(params)

    (model, params), added = peak(load)
    held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    result = dict(process=process_id, added=added, f32_bytes=f32_bytes, held=held)
    if out is not None:
        result |= export(pathlib.Path(out), model.config, model, params, shard)
    print(json.dumps(result), flush=True)


def check_exports(out: pathlib.Path) -> dict:
    """Load both exports with transformers (compressed-tensors decompresses on the first forward):
    the :data:`CHECKED` tensors of the Hugging Face export must equal the params, the
    :data:`CHECKED_QUANTIZED` modules of the compressed one the frozen weights dequantized, bit for
    bit (f32 written, f32 read)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).state_dict()
    want = np.load(out / "checked.npz")
    equal = {f"hf {n}": bool(np.array_equal(hf[n].numpy(), want[n])) for n in CHECKED}
    del hf
    ct = AutoModelForCausalLM.from_pretrained(out / "ct", dtype=torch.float32)
    with torch.no_grad():
        ct(torch.zeros((1, 4), dtype=torch.long))
    want = np.load(out / "dequantized.npz")
    for n in CHECKED_QUANTIZED:
        loaded = ct.get_submodule(n.removesuffix(".weight")).weight.detach().numpy()
        equal[f"compressed {n}"] = bool(np.array_equal(loaded, want[n]))
    if not all(equal.values()):
        sys.exit(f"a transformers load of the exports in {out} differs: {equal}")
    return equal


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
    ap.add_argument("--export", action="store_true", help="then measure the two exports (docstring)")
    ap.add_argument("--out", default="/tmp/qarl_host_ram_export", help="where --export writes")
    ap.add_argument("--max-shard-mib", type=int, default=256, help="the exports' max_shard_bytes")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shard = args.max_shard_mib * 1024**2
    if args.child:
        out = args.out if args.export else None
        child(args.child[0], args.child[1], int(args.child[2]), args.scan_layers, out, shard)
        return
    if args.export:
        shutil.rmtree(args.out, ignore_errors=True)
    ckpt = pathlib.Path(args.dir)
    make_checkpoint(ckpt)
    coordinator = f"localhost:{free_port()}"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices // 2}",
    )
    argv = [sys.executable, __file__, "--child", str(ckpt), coordinator]
    flags = ["--scan-layers"] if args.scan_layers else []
    if args.export:
        flags += ["--export", "--out", args.out, "--max-shard-mib", str(args.max_shard_mib)]
    procs = [
        subprocess.Popen([*argv, str(i), *flags], env=env, stdout=subprocess.PIPE, text=True)
        for i in range(2)
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
        for key in ("gather_embedding", "export_hf", "export_compressed", "frozen_held"):
            if key in r:
                r[key + "_over_f32"] = round(r[key] / r["f32_bytes"], 3)
    report: dict = dict(checkpoint=str(ckpt), scan_layers=args.scan_layers, hosts=results)
    if args.export:
        report |= dict(max_shard_bytes=shard, loads_equal=check_exports(pathlib.Path(args.out)))
    print(json.dumps(report, indent=2))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report if args.export else results, indent=2))


if __name__ == "__main__":
    main()
