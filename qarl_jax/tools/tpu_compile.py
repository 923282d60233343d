"""``python -m qarl_jax.tools.tpu_compile [--topology NAME ...] [--preset NAME] [--formats F,...] [--json]``

Compiles every kernel a run executes with the real TPU compiler (XLA:TPU and Mosaic, from
``libtpu``) on this CPU host, for TPU chips that are not here: ``--topology`` names a slice
(``v5p:2x2x1``, ``v6e:2x2``, ...; default one slice of each generation), ``--preset`` the model whose
shapes the kernels get (default ``qwen3-8b``). Per generation and program it prints whether it
compiled (and in how long) or the compiler's one-line reason. Nothing is allocated and no chip is
needed: the inputs are ``jax.ShapeDtypeStruct``s placed on the topology's device descriptions.

What this proves: the TPU compiler accepts the programs (Mosaic's layout, tiling and MXU rules,
XLA:TPU's memory plan). What it cannot: speed on silicon, and the bits a chip computes (Pallas'
TPU interpreter checks the semantics; identical compiled kernels on both sides give identical bits,
see :func:`mosaic_kernels`). The whole run's programs for a real slice:
``python -m qarl_jax.tools.memory_plan --compiled --topology v5p:4x4x2``.

Needs ``libtpu``: ``pip install -e ".[tpu]"`` (or ``.[dev]``), on any host.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import kernels_pallas as kp
from kernels_pallas import formats
from kernels_pallas.attention import attention
from kernels_pallas.attention import tpu as attention_tpu
from kernels_pallas.rowwise import rms_norm, rope, token_logprobs
from qarl_jax import cli
from qarl_jax.errors import PlanError
from qarl_jax.models import TransformerConfig, preset
from qarl_jax.tools.program_cost import mosaic_calls

# a small slice of each generation (the kernels run on one chip of it); TPU v4 has no int8 MXU
DEFAULT_TOPOLOGIES = ("v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:2x2", "tpu7x:2x2x1")
# libtpu outside a TPU VM: no metadata server to ask, several processes may load it (pytest's
# workers; it only compiles), and no worker list (without these it prints start-up warnings)
_LIBTPU_ENV = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


def generation(topology: str) -> str:
    """The chip generation of a topology name (``v5p:4x4x2`` -> ``v5p``, ``tpu7x:2x2x1`` -> ``tpu7x``)."""
    return topology.split(":", 1)[0]


def _accelerator_type(topology: str) -> str | None:
    """The Cloud TPU accelerator type of a slice (``v5p:4x4x2`` -> ``v5p-64``: v4 and v5p count
    TensorCores, two a chip; v5e and v6e count chips), which libtpu asks for at start-up."""
    gen, _, shape = topology.partition(":")
    chips = int(np.prod([int(d) for d in shape.split("x")])) if re.fullmatch(r"\d+(x\d+)*", shape) else 0
    names = {"v4": ("v4", 2), "v5p": ("v5p", 2), "v5e": ("v5litepod", 1), "v6e": ("v6e", 1)}
    return f"{names[gen][0]}-{chips * names[gen][1]}" if gen in names and chips else None


def topology_devices(topology: str) -> list[jax.Device]:
    """The device descriptions of a TPU slice, from the TPU compiler with no chip attached; a
    missing ``libtpu`` or an unknown name is a :class:`PlanError` naming it."""
    for key, value in _LIBTPU_ENV.items():
        os.environ.setdefault(key, value)
    accelerator = _accelerator_type(topology)  # read once, when libtpu starts; the compile target
    if accelerator:  # is the topology's own chip whatever it says
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator)
    try:
        import libtpu  # noqa: F401  (only whether it is installed)
    except ImportError:
        raise PlanError(
            f"compiling for TPU topology {topology!r} needs libtpu: pip install -e '.[tpu]'"
        ) from None
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
    except Exception as e:  # libtpu's own errors: a malformed or unknown name
        raise PlanError(f"TPU topology {topology!r}: {_first_line(e)} (e.g. v5p:4x4x2, v6e:2x2)") from None


@contextmanager
def tpu_kernels() -> Iterator[None]:
    """Within the block, kernels traced without a named backend are the Mosaic ones (the host's
    default backend is the CPU, whose programs are plain JAX)."""
    with kp.default_backend("tpu"):
        yield


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def failure_line(e: BaseException) -> str:
    """The compiler's reason in one line: Mosaic's error (and what it means where we know), else
    the first line of the error."""
    text = str(e)
    reason = re.search(r"Mosaic failed to compile TPU kernel: (.*)", text)
    if not reason:
        return f"{type(e).__name__}: {_first_line(e)}"
    line = f"Mosaic rejects a kernel: {reason.group(1).strip()}"
    if re.search(r"Unsupported matmul \w+ type on target: vector<[\dx]*xi8>", text):
        line += " (this TPU generation has no int8 matmul unit: the a8 formats, w8a8 and w4a8, need one)"
    return line


@dataclasses.dataclass(frozen=True)
class MosaicKernel:
    """One Mosaic kernel of a compiled TPU program: its name, its grid (``iteration_bounds``), and
    a digest of everything else the TPU compiler gets (the kernel body, block shapes, dimension
    semantics, scratch): two calls with one digest run the same program on every grid cell."""

    name: str
    grid: tuple[int, ...]
    digest: str


def mosaic_kernels(hlo_text: str) -> list[MosaicKernel]:
    """The Mosaic kernels of a compiled TPU program's HLO (``compiled.as_text()``), in order.

    Why the grid is kept apart: it is the one thing M may change (how many row blocks or tokens
    there are), and it leaves each cell's program alone; block shapes are in the digest, so a
    tiling that depended on M would show as a different digest. For the same reason the lengths
    of the scalar-prefetched SMEM work lists are left out (the grouped matmul's list of (expert,
    row block) tiles has one entry a grid step: its length is the grid's)."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import tpu
    from jaxlib.mlir import ir
    from jaxlib.mlir.passmanager import PassManager

    ctx = jax_mlir.make_ir_context()
    tpu.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    kernels = []
    for _, line, config in mosaic_calls(hlo_text):
        if config is None:
            raise ValueError(f"a tpu_custom_call without a backend_config: {line[:200]}")
        with ctx:
            module = ir.Module.parse(base64.b64decode(config["custom_call_config"]["body"]))
            PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
            text = str(module)
        bounds = re.search(r"iteration_bounds = array<i64(?:: ([\d, ]*))?>", text)
        grid = tuple(int(x) for x in bounds.group(1).split(",")) if bounds and bounds.group(1) else ()
        name = re.search(r"func\.func @(\w+)", text)
        body = _without_extents(text, EXTENTS.get(name.group(1), {}) if name else {}, len(grid))
        body = re.sub(r"iteration_bounds = array<i64[^>]*>", "", body)
        body = re.sub(r"memref<\d+x(i32, #tpu\.memory_space<smem>)>", r"memref<?x\1>", body)
        kernels.append(
            MosaicKernel(name.group(1) if name else "?", grid, hashlib.sha256(body.encode()).hexdigest()[:16])
        )
    return kernels


# a kernel's blocks whose extent (a sequence length) its docstring shows changes no row's bits:
# {kernel name: {block index: axis}}
EXTENTS: dict[str, dict[int, int]] = {"qarl_attention_tpu": attention_tpu.EXTENT_AXES}


def _without_extents(text: str, axes: dict[int, int], grid_rank: int) -> str:
    """The Mosaic module ``text`` with the extent of each block ``axes`` names (block index -> axis)
    written ``?``: in its window bounds and its memref type, wherever that type occurs (a load, a
    store); nothing else changes. Blocks count from the first operand after the grid indices and
    the scalar-prefetched operands."""
    if not axes:
        return text
    sig = re.search(r"func\.func @\w+\((.*?)\) attributes \{(.*)", text)
    prefetch = re.search(r"scalar_prefetch = (\d+)", text)
    assert sig and prefetch, "not a Mosaic kernel's module"
    types = re.findall(r"%arg\d+: (memref<[^<>]*(?:<[^<>]*>)?>|\w+)", sig.group(1))
    blocks = types[grid_rank + int(prefetch.group(1)) :]
    for i, axis in axes.items():
        shape, rest = re.fullmatch(r"memref<([\dx]+?)x([a-z]\w*, .*)", blocks[i]).groups()  # type: ignore[union-attr]
        dims = shape.split("x")
        dims[axis] = "?"
        text = text.replace(blocks[i], f"memref<{'x'.join(dims)}x{rest}")
    windows = iter(range(len(blocks)))

    def bound(m: re.Match) -> str:
        i, dims = next(windows), m.group(1).split(", ")
        if i in axes:
            dims[axes[i]] = "?"
        return f"window_bounds = array<i64: {', '.join(dims)}>"

    return re.sub(r"window_bounds = array<i64: ([\d, ]+)>", bound, text)


def same_kernels(rollout: list[MosaicKernel], training: list[MosaicKernel]) -> tuple[list[str], list[str]]:
    """(the rollout's Mosaic kernels that the training programs also run, those they do not), as
    ``name:digest``: the compiler-level form of "rollout and training run the same kernels" (one
    digest: one program for every grid cell, whatever M, T or, for attention, S)."""
    trained = {(k.name, k.digest) for k in training}
    keys = sorted({(k.name, k.digest) for k in rollout})
    shared = [f"{n}:{d}" for n, d in keys if (n, d) in trained]
    return shared, [f"{n}:{d}" for n, d in keys if (n, d) not in trained]


@dataclasses.dataclass(frozen=True)
class Program:
    """A program to compile: its name, the function and its abstract arguments (unplaced)."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Result:
    """A program compiled (``error`` None) or refused, on one topology, and the compile time."""

    program: str
    topology: str
    seconds: float
    error: str | None = None
    kernels: tuple[MosaicKernel, ...] = ()


def compile_on(topology: str, program: Program, devices: list[jax.Device] | None = None) -> Result:
    """``program`` jitted, lowered and compiled for one chip of ``topology`` with the Mosaic kernels."""
    devices = devices or topology_devices(topology)
    one_chip = NamedSharding(Mesh(np.array(devices[:1]), ("chip",)), PartitionSpec())
    placed = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one_chip), program.args)
    start = time.perf_counter()
    try:
        with tpu_kernels():
            compiled = jax.jit(program.fn).lower(*placed).compile()
    except Exception as e:  # the compiler's refusal is the answer, reported per program
        return Result(program.name, topology, time.perf_counter() - start, failure_line(e))
    seconds = time.perf_counter() - start
    return Result(program.name, topology, seconds, None, tuple(mosaic_kernels(compiled.as_text() or "")))


def _struct(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _weight(fmt: str, shape: tuple[int, ...]) -> formats.QuantizedWeight:
    group = formats.DEFAULT_GROUP_SIZE if formats.WEIGHT_BITS[fmt] == 4 else None
    master = jnp.bfloat16 if fmt == "bf16" else jnp.float32
    return jax.eval_shape(lambda: formats.quantize(jnp.zeros(shape, master), fmt, group))


def _sum(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    return lambda *a: jnp.sum(fn(*a).astype(jnp.float32))


def kernel_programs(c: TransformerConfig, fmt: str, rows: int = 16, tokens: int = 256) -> list[Program]:
    """Every kernel of a ``c``-shaped model in ``fmt`` as a program of its own: the matmul at each
    distinct projection shape and ``rows`` rows (a decode batch), its straight-through gradient, the
    grouped expert matmul and its gradient (MoE), attention over ``tokens`` (forward, gradient, and
    a one-token decode against a cache), the row-wise kernels (and their gradients)."""
    h, d, bf = c.hidden_size, c.head_dim, jnp.bfloat16
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    group = formats.DEFAULT_GROUP_SIZE if formats.WEIGHT_BITS[fmt] == 4 else None
    shapes = {(h, q), (h, kv), (q, h), (h, c.vocab_size)}
    if not c.is_moe or not all(c.is_moe_layer(i) for i in range(c.num_hidden_layers)):
        shapes |= {(h, c.intermediate_size), (c.intermediate_size, h)}
    out: list[Program] = []
    for k, n in sorted(shapes):
        out.append(
            Program(
                f"matmul {k}x{n}",
                lambda x, w: kp.quantized_matmul(x, w),
                (_struct((rows, k), bf), _weight(fmt, (k, n))),
            )
        )
    k, n = h, q
    ste = lambda x, w: kp.quantized_matmul_ste(x, w, fmt, group)  # noqa: E731
    out.append(
        Program(
            f"matmul {k}x{n} gradient",
            jax.grad(_sum(ste), (0, 1)),
            (_struct((tokens, k), bf), _struct((k, n), "float32")),
        )
    )
    if c.is_moe:
        e, i = c.num_experts, c.moe_intermediate_size
        sizes = _struct((e,), "int32")
        out.append(
            Program(
                f"grouped {h}x{i} x{e}",
                lambda x, w, s: kp.grouped_matmul(x, w, s),
                (_struct((tokens, h), bf), _weight(fmt, (e, h, i)), sizes),
            )
        )
        gste = lambda x, w, s: kp.grouped_matmul_ste(x, w, s, fmt, group)  # noqa: E731
        out.append(
            Program(
                f"grouped {h}x{i} x{e} gradient",
                jax.grad(_sum(gste), (0, 1)),
                (_struct((tokens, h), bf), _struct((e, h, i), "float32"), sizes),
            )
        )
    pos = _struct((1, tokens), "int32")
    qs, ks = (
        _struct((1, tokens, c.num_attention_heads, d), bf),
        _struct((1, tokens, c.num_key_value_heads, d), bf),
    )
    out += [
        Program("attention", attention, (qs, ks, ks, pos)),
        Program("attention gradient", jax.grad(_sum(attention), (0, 1, 2)), (qs, ks, ks, pos)),
        Program(
            "attention decode",
            attention,
            (
                _struct((rows, 1, c.num_attention_heads, d), bf),
                *[_struct((rows, tokens, c.num_key_value_heads, d), bf)] * 2,
                _struct((rows, 1), "int32"),
            ),
        ),
    ]
    x, w = _struct((tokens, h), bf), _struct((h,), bf)
    norm = lambda x, w: rms_norm(x, w, c.rms_norm_eps)  # noqa: E731
    rot = lambda x, p: rope(x, p, c.rope_theta, c.rope_inv_freq)  # noqa: E731
    rope_args = (_struct((tokens, c.num_attention_heads, d), bf), _struct((tokens,), "int32"))
    logits, targets = _struct((rows, c.vocab_size), bf), _struct((rows,), "int32")
    out += [
        Program("rms_norm", norm, (x, w)),
        Program("rms_norm gradient", jax.grad(_sum(norm), (0, 1)), (x, w)),
        Program("rope", rot, rope_args),
        Program("rope gradient", jax.grad(_sum(rot)), rope_args),
        Program("token_logprobs", lambda x, t: token_logprobs(x, t, 0.7), (logits, targets)),
        Program(
            "token_logprobs gradient",
            jax.grad(_sum(lambda x, t: token_logprobs(x, t, 0.7))),
            (logits, targets),
        ),
    ]
    return out


def check_kernels(
    topologies: list[str], c: TransformerConfig, fmts: list[str], progress: bool = True
) -> list[Result]:
    """:func:`kernel_programs` of every format compiled on every topology (the format-free
    programs once per topology)."""
    results: list[Result] = []
    for topology in topologies:
        devices = topology_devices(topology)
        seen: set[str] = set()
        for fmt in fmts:
            for program in kernel_programs(c, fmt):
                quantized = program.name.startswith(("matmul", "grouped"))
                if not quantized and program.name in seen:
                    continue
                seen.add(program.name)
                name = f"{program.name} {fmt}" if quantized else program.name
                result = compile_on(topology, dataclasses.replace(program, name=name), devices)
                results.append(result)
                if progress:
                    status = "ok" if result.error is None else result.error
                    print(
                        f"{topology:>12}  {name:<40} {result.seconds:6.1f} s  {status}",
                        file=sys.stderr,
                        flush=True,
                    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(
        prog="python -m qarl_jax.tools.tpu_compile", description=cli.plain(__doc__.split("\n\n")[1])
    )
    parser.add_argument(
        "--topology", nargs="+", default=list(DEFAULT_TOPOLOGIES), help="TPU slices, e.g. v5p:2x2x1 v6e:2x2"
    )
    parser.add_argument("--preset", default="qwen3-8b", help="the model whose shapes the kernels get")
    parser.add_argument(
        "--formats", default=",".join(formats.FORMATS), help="comma-separated, e.g. w8a8,w4a16"
    )
    cli.add_json(parser, "every program's result")
    args = parser.parse_args(argv)
    return cli.run(lambda: _main(args))


def _main(args) -> int:
    fmts = [f for f in args.formats.split(",") if f]
    unknown = [f for f in fmts if f not in formats.FORMATS]
    if unknown:
        raise PlanError(
            f"--formats: unknown format {unknown[0]!r}; the formats are {', '.join(formats.FORMATS)}"
        )
    try:
        c = preset(args.preset)
    except ValueError as e:
        raise PlanError(f"--preset: {e}") from None
    results = check_kernels(args.topology, c, fmts, progress=True)
    failed = [r for r in results if r.error]
    if args.json:
        print(json.dumps(dict(preset=args.preset, programs=[dataclasses.asdict(r) for r in results])))
    else:
        for r in failed:
            print(f"{r.topology}: {r.program}: {r.error}")
        print(
            f"{len(results) - len(failed)} of {len(results)} programs compiled for TPU ({args.preset} shapes)"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
