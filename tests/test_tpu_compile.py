"""Every TPU program compiled by the real TPU compiler (XLA:TPU and Mosaic from libtpu) on this
CPU host, for slices with no chip attached: the kernels x formats on two generations, and the
tiny presets' whole run (old log-probs, the aligned update, prefill, decode step) on a v5p slice,
dense (Qwen3, Qwen2 and Llama 3) and MoE, with every format's kernels there in both compute
dtypes. Lowering alone accepted kernels that Mosaic rejects ("Bad lhs type" on every quantized
matmul) and missed a gradient that does not trace for TPU: only the compiler says. libtpu comes
with the dev extras: a missing one fails here, it is not skipped."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import kernels_pallas as kp
from kernels_pallas import FORMATS
from kernels_pallas.attention import attention
from kernels_pallas.formats import DEFAULT_GROUP_SIZE, WEIGHT_BITS
from qarl_jax.models import preset
from qarl_jax.tools import memory_plan, tpu_compile
from qarl_jax.tools.program_cost import Cost, program_cost
from qarl_jax.tools.tpu_compile import (
    Program,
    check_kernels,
    compile_on,
    failure_line,
    kernel_programs,
    mosaic_kernels,
    topology_devices,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2", "tpu7x:2x2x1"])  # v5p: the whole-run cells
def test_every_kernel_compiles_for_tpu(topology):
    results = check_kernels([topology], preset("qwen3-moe-tiny"), list(FORMATS), progress=False)
    failed = [f"{r.program}: {r.error}" for r in results if r.error]
    assert not failed, failed
    names = {k.name for r in results for k in r.kernels}
    for fmt in FORMATS:  # the quantized programs reached Mosaic, not a fallback
        assert f"qarl_{fmt}_matmul_tpu" in names and f"qarl_{fmt}_grouped_matmul_tpu" in names
    assert {"qarl_attention_tpu", "qarl_rms_norm_tpu", "qarl_rope_tpu", "qarl_logsumexp_tpu"} <= names


def test_v4_refuses_the_int8_formats_in_one_line():
    """TPU v4 has no int8 MXU: its int8-activation matmuls fail with one line that says so; bf16,
    w4a16 and fp8 (e4m3 widened to bf16, a bf16 dot) compile."""
    c = preset("qwen3-tiny")
    devices = topology_devices("v4:2x2x1")
    for fmt in FORMATS:
        program = next(p for p in kernel_programs(c, fmt) if p.name.startswith("matmul"))
        result = compile_on("v4:2x2x1", program, devices)
        if fmt in ("w8a8", "w4a8"):
            assert result.error and "\n" not in result.error and "no int8 matmul unit" in result.error
        else:
            assert result.error is None, result.error


def test_a_kernel_mosaic_rejects_is_reported_not_hidden():
    """Negative control: the dot this project's kernels used to ask for (bf16 operands at
    precision=HIGHEST) is refused, and the refusal is one line."""

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.dot(
            x_ref[...], x_ref[...], preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
        )

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((128, 128), jnp.float32))
    program = Program("highest bf16 dot", call, (jax.ShapeDtypeStruct((128, 128), jnp.bfloat16),))
    result = compile_on("v5e:2x2", program)
    assert result.error is not None and "\n" not in result.error
    assert result.error.startswith("Mosaic rejects a kernel") and "Bad lhs type" in result.error


def _matmul_kernels(m: int, **tiling) -> list:
    w = jax.eval_shape(lambda: kp.quantize(jnp.zeros((512, 256)), "w4a16", 128))
    fn = functools.partial(kp.quantized_matmul, **tiling)
    program = Program("m", fn, (jax.ShapeDtypeStruct((m, 512), jnp.bfloat16), w))
    result = compile_on("v5p:2x2x1", program)
    assert result.error is None, result.error
    return list(result.kernels)


def test_kernel_digest_is_the_program_and_tiling_not_the_rows():
    """A decode batch and a training chunk run one kernel (same digest, another grid); another K
    tiling is another kernel (the check can tell them apart)."""
    (decode,), (train,) = _matmul_kernels(16), _matmul_kernels(160)
    assert decode.name == train.name == "qarl_w4a16_matmul_tpu"
    assert decode.digest == train.digest and decode.grid != train.grid
    (other,) = _matmul_kernels(16, block_k=128)
    assert other.digest != decode.digest


def _attention_operands(b: int, t: int, s: int) -> tuple:
    """Attention over ``b`` rows of ``t`` queries and ``s`` keys (segment ids and starts passed, as
    a packed training row passes them)."""
    q = jax.ShapeDtypeStruct((b, t, 16, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, s, 8, 128), jnp.bfloat16)
    ids, kv_ids = jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.int32)
    return (q, k, k, ids, ids, ids, kv_ids)


def test_attention_is_one_kernel_for_training_prefill_and_decode():
    """A packed training row (T = S = 256), a prefill chunk against a cache (T = 64, S = 512) and a
    decode step (T = 1, S = 512) run one Mosaic attention kernel: S and T are SMEM operands and the
    grid, and the digest abstracts the K/V blocks' key extent alone. Negative control: another key
    block size is another kernel (a decode of 8 rows: each call is told apart by its grid). The
    four calls are one program, each its own kernel."""
    shapes = {"train": (1, 256, 256), "prefill": (4, 64, 512), "decode": (16, 1, 512), "other": (8, 1, 512)}
    blocks = {"train": None, "prefill": None, "decode": None, "other": 16}

    def calls(*operands):
        return [
            attention(*operands[7 * i : 7 * i + 7], block_kv=block) for i, block in enumerate(blocks.values())
        ]

    operands = sum((_attention_operands(*shape) for shape in shapes.values()), ())
    result = compile_on("v5p:2x2x1", Program("attention", calls, operands))
    assert result.error is None, result.error
    assert len(result.kernels) == 4 and {k.name for k in result.kernels} == {"qarl_attention_tpu"}
    by_grid = {k.grid: k for k in result.kernels}  # the grid (rows, kv heads, queries): the call's own
    train, prefill, decode, other = (by_grid[(b, 8, t)] for b, t, _ in shapes.values())
    assert train.digest == prefill.digest == decode.digest
    assert other.digest != decode.digest


def test_program_cost_counts_loop_trips_slices_and_in_place_updates():
    """XLA's cost_analysis counts a scan's body once; program_cost counts it per trip (10 layers:
    10x the FLOPs of one, each layer's weights read once, a slice of the stack), and a KV-cache
    style in-place update moves the update, not the buffer."""
    devices = topology_devices("v5p:2x2x1")
    one = NamedSharding(Mesh(np.array(devices[:1]), ("chip",)), PartitionSpec())
    x = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16, sharding=one)

    def cost(n: int) -> Cost:
        w = jax.ShapeDtypeStruct((n, 1024, 1024), jnp.bfloat16, sharding=one)
        scan = lambda x, w: jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]  # noqa: E731
        return program_cost(jax.jit(scan).lower(x, w).compile().as_text())

    one_layer, ten = cost(1), cost(10)
    assert one_layer.flops == 2 * 256 * 1024 * 1024 and ten.flops == 10 * one_layer.flops
    weights = 1024 * 1024 * 2
    assert weights < one_layer.hbm_bytes < 2 * weights and 10 * weights < ten.hbm_bytes < 30 * weights
    cache = jax.ShapeDtypeStruct((4, 2048, 8, 128), jnp.bfloat16, sharding=one)
    update = jax.ShapeDtypeStruct((4, 1, 8, 128), jnp.bfloat16, sharding=one)
    i = jax.ShapeDtypeStruct((), jnp.int32, sharding=one)
    write = jax.jit(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, (0, i, 0, 0)), donate_argnums=0)
    assert (
        program_cost(write.lower(cache, update, i).compile().as_text()).hbm_bytes <= 3 * 4 * 8 * 128 * 2 + 64
    )


def test_mosaic_kernels_needs_compiled_tpu_text():
    assert mosaic_kernels("HloModule m\nENTRY e {\n}\n") == []
    assert failure_line(ValueError("first\nsecond")) == "ValueError: first"
    with pytest.raises(ValueError, match="without a backend_config"):
        mosaic_kernels('ENTRY e {\n  %k = f32[8] custom-call(), custom_call_target="tpu_custom_call"\n}\n')


def test_mosaic_kernels_read_a_backend_config_over_line_breaks(monkeypatch):
    """The 235B's compiled old-log-prob pass printed a kernel's backend_config with a line break in
    its cost estimate (a line-by-line read failed there): the JSON object is read from the whole
    text."""
    texts = []
    monkeypatch.setattr(tpu_compile, "mosaic_kernels", lambda text: texts.append(text) or ())
    _matmul_kernels(16)
    monkeypatch.undo()
    (text,) = texts
    target = 'custom_call_target="tpu_custom_call"'
    head, tail = text.split(target)
    # JSON whitespace, a line break, inside the kernel's backend_config
    broken = head + target + tail.replace("backend_config={", "backend_config={\n  ", 1)
    assert mosaic_kernels(broken) == mosaic_kernels(text) != []


# f32 master weights in all; the dense models compute in f32 (the default run: f32 dots at HIGHEST
# in Mosaic), the MoE in bf16 (what real configs use: bf16 and int8 MXU dots). A format changes the
# run's programs only in its matmul kernels (the model code is format-free), so the whole run is
# compiled in five cells and every format x compute dtype's kernels in
# test_every_format_compiles_for_v5p_and_decodes_with_the_training_kernels (seconds, where a cell
# costs 10-25 s): the MoE in w4a16 (the real configs') and w8a8 (int8 MXU dots, grouped too); the
# dense families each where their code differs (Qwen2's q/k/v biases and no q/k norms, Llama 3's
# llama3 RoPE frequencies), in the format its rows use (the Qwen2.5-Math configs' w4a16, the rollout
# matrix's Llama fp8), and Qwen3 in bf16 (the README's bf16-rollout floors).
CELLS = [
    ("qwen3-tiny", "float32", "bf16"),
    ("qwen2-tiny", "float32", "w4a16"),
    ("llama-tiny", "float32", "fp8"),
    ("qwen3-moe-tiny", "bfloat16", "w4a16"),
    ("qwen3-moe-tiny", "bfloat16", "w8a8"),
]


def test_the_v5p_cells_cover_the_families_code_and_both_compute_dtypes():
    spec = {name: preset(name).spec for name, _, _ in CELLS}
    assert spec["qwen2-tiny"].qkv_bias and not spec["qwen2-tiny"].qk_norm
    assert preset("llama-tiny").rope_scaling is not None and not spec["llama-tiny"].qk_norm
    assert spec["qwen3-tiny"].qk_norm and not spec["qwen3-tiny"].qkv_bias
    assert {compute for _, compute, _ in CELLS} == {"float32", "bfloat16"}


def _kernels(program: Program, devices: list) -> set[tuple[str, str]]:
    result = compile_on("v5p:2x2x1", program, devices)
    assert result.error is None, f"{program.name}: {result.error}"
    assert result.kernels, f"{program.name}: no Mosaic kernel (a fallback ran)"
    return {(k.name, k.digest) for k in result.kernels}


def _decode_and_training_kernels(fmt: str, forward, frozen, master, rows: tuple, devices: list) -> None:
    """``forward`` (a decode step's: ``rows[0]`` rows against the frozen weight) and its
    straight-through training twin (``rows[1]`` rows against the f32 master weight, with its
    gradient) compiled for a v5p chip; the decode step's kernels are training kernels."""
    x, *rest = frozen
    step = _kernels(
        Program(f"{fmt} decode", forward, (_struct((rows[0], *x.shape), x.dtype), *rest)), devices
    )
    x, *rest = master
    value_and_grad = jax.value_and_grad(
        lambda x, *a: jnp.sum(forward(x, *a, ste=True).astype(jnp.float32)), (0, 1)
    )
    args = (_struct((rows[1], *x.shape), x.dtype), *rest)
    assert step <= _kernels(Program(f"{fmt} update", value_and_grad, args), devices), fmt
    assert {name for name, _ in step} == {f"qarl_{fmt}_{forward.__name__}_tpu"}, step


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_every_format_compiles_for_v5p_and_decodes_with_the_training_kernels(compute):
    """What a format changes in the run, for every format: its matmul (and, in bf16 like the MoE
    runs, its grouped expert matmul) at a decode step's rows, and the training forward and its
    straight-through gradient at a training chunk's rows, all compiled for a v5p chip; the decode
    kernel is one the training program runs (same digest: same body and tiling, another grid), the
    whole run's check (test_the_run_compiles_for_a_v5p_slice) at the kernels' level."""
    devices = topology_devices("v5p:2x2x1")
    dense, moe = preset("qwen3-tiny"), preset("qwen3-moe-tiny")
    k, n = dense.hidden_size, dense.intermediate_size
    e, ki, ni = moe.num_experts, moe.hidden_size, moe.moe_intermediate_size
    x, xi, sizes = _struct((k,), compute), _struct((ki,), compute), _struct((e,), jnp.int32)
    for fmt in FORMATS:
        group = DEFAULT_GROUP_SIZE if WEIGHT_BITS[fmt] == 4 else None

        def frozen(*shape, fmt=fmt, group=group):
            return jax.eval_shape(lambda: kp.quantize(jnp.zeros(shape, jnp.float32), fmt, group))

        def matmul(x, w, ste=False, fmt=fmt, group=group):
            return kp.quantized_matmul_ste(x, w, fmt, group) if ste else kp.quantized_matmul(x, w)

        def grouped_matmul(x, w, s, ste=False, fmt=fmt, group=group):
            return kp.grouped_matmul_ste(x, w, s, fmt, group) if ste else kp.grouped_matmul(x, w, s)

        master = _struct((k, n), jnp.float32)
        _decode_and_training_kernels(fmt, matmul, (x, frozen(k, n)), (x, master), (16, 256), devices)
        if compute == "bfloat16":
            master = _struct((e, ki, ni), jnp.float32)
            args = (xi, frozen(e, ki, ni), sizes), (xi, master, sizes)
            _decode_and_training_kernels(fmt, grouped_matmul, *args, (16, 256), devices)


def _struct(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def test_program_cost_reads_a_relaid_stack_by_the_layer():
    """A scanned stack of packed int4 weights feeding the Mosaic matmul: XLA:TPU slices each layer
    out through a nested fusion that re-tiles the stack (``copy_fusion``), fused into the kernel's
    reads (``allow_input_fusion``: a ``kCustom`` fusion), so the kernel reads its layer's slice
    where it lies: not the whole stack (counted whole, the 8B's w4a16 decode step was 166 GB a
    step), and not a copy of the slice first (~4x the packed bytes before the kernel fused it)."""
    one = NamedSharding(Mesh(np.array(topology_devices("v5p:2x2x1")[:1]), ("chip",)), PartitionSpec())
    layers, k, n = 4, 1024, 1024
    w = jax.eval_shape(lambda: kp.quantize(jnp.zeros((layers, k, n), jnp.float32), "w4a16", 128))
    w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), w)
    x = jax.ShapeDtypeStruct((16, k), jnp.bfloat16, sharding=one)
    scan = lambda x, w: jax.lax.scan(lambda c, wi: (kp.quantized_matmul(c, wi, backend="tpu"), None), x, w)[0]  # noqa: E731
    text = jax.jit(scan).lower(x, w).compile().as_text()
    assert "copy_fusion" in text and "kind=kCustom" in text  # the re-tiling, fused into the kernel
    packed = layers * k * n // 2  # each layer's slice read once by the kernel (and x, scales, out)
    assert packed < program_cost(text).hbm_bytes < 2 * packed


@pytest.mark.parametrize("name, compute, fmt", CELLS)
def test_the_run_compiles_for_a_v5p_slice(name, compute, fmt, capsys):
    """memory_plan --topology: every program of the run compiled for v5p chips (the aligned update
    with its gradient through the Mosaic kernels included), and every Mosaic kernel of the decode
    step and the prefill (matmuls, attention, RMSNorm, RoPE, log-sum-exp) is one the training
    programs run (same body and tiling; grid and, for attention, the key extent aside). The decode
    step moves at most 2.5x its frozen weights plus its KV cache a step (the cache in the kernel's
    layout: no per-layer copies of it), read off the programs compiled here (once a memory_plan
    compile of its own in test_kv_cache_layout)."""
    code = memory_plan.main(
        [
            "--topology",
            "v5p:2x2x1",
            "--json",
            "model.path=null",
            f"model.preset={name}",
            f"model.compute_dtype={compute}",
            f"model.num_hidden_layers={2 if name == 'qwen3-moe-tiny' else 1}",
            f"quant.fmt={fmt}",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    compiled = out["compiled"]
    assert compiled["topology"] == "v5p:2x2x1" and compiled["fits"]
    programs = compiled["programs"]
    assert set(programs) == {"old_logprobs", "update", "prefill", "decode_step"}
    rollout = set(programs["decode_step"]["mosaic_kernels"]) | set(programs["prefill"]["mosaic_kernels"])
    training = set(programs["update"]["mosaic_kernels"]) | set(programs["old_logprobs"]["mosaic_kernels"])
    # every kernel of the rollout is a training kernel, attention included, and the sampler's
    # tempered log-sum-exp (f32 logits / a per-slot temperature) where the trainer's logits are
    # bf16 (the MoE cells): the TPU kernel reads f32 whatever the logits' dtype
    assert rollout <= training, rollout - training
    for name, x in programs.items():  # the compiled program's cost and its floor on a v5p chip
        assert x["hbm_bytes"] > 0 and x["flops"] > 0 and x["seconds_floor"] > 0, name
    step = compiled["rl_step_floor"]
    assert set(step["parts"]) == {*programs, "weight_sync"}
    assert step["seconds_floor"] == pytest.approx(sum(step["parts"].values()))
    names = {k.split(":")[0] for k in rollout}
    assert {"qarl_attention_tpu", "qarl_rms_norm_tpu", "qarl_rope_tpu", f"qarl_{fmt}_matmul_tpu"} <= names
    # the decode step moves its frozen weights and its KV cache (the padded one the chip holds), not
    # copies of them: before the cache took the kernel's layout, each layer's K/V was sliced out of
    # the stack, transposed and padded for the kernel (19x on qwen3-small, 44 of 12 GB a chip on
    # Qwen3-8B)
    moved = programs["decode_step"]["hbm_bytes"]
    held = out["plan"]["bytes"]["frozen"] + compiled["kv_cache_bytes"]
    assert moved <= 2.5 * held, (moved, held)
