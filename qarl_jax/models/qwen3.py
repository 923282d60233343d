"""Qwen3 dense and Qwen3-MoE causal LMs in Flax linen.

Numerically the Hugging Face models (checked against transformers in the tests), with two seams
that the rest of qarl-jax relies on: every projection goes through ``qarl_jax.quant.dot`` /
``grouped_dot`` (one matmul entry point: quantized kernels plug in everywhere at once) and every
row-wise op through ``qarl_jax.models.ops``. A layer's per-token work runs as two fused chains
(``ops.fused_tokens``: input norm, q/k/v, q/k norms, RoPE; then o_proj, residual, norm, dense MLP,
residual), each one row-block program on the CPU; the attention sits between them. Parameters and
activations carry logical axis names (see ``qarl_jax.sharding``).

Two entry points share the weights:
  ``model.apply(v, tokens, positions=None, segment_ids=None)`` -> logits  (training / scoring)
  ``model.apply(v, tokens, positions, cache, method="decode")`` -> (logits, cache)  (rollout)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from kernels_pallas import fused, rowwise
from kernels_pallas.attention import CacheLayout, Visibility, cache_layout
from qarl_jax import quant, sharding
from qarl_jax.models import moe, ops
from qarl_jax.models.config import TransformerConfig
from qarl_jax.models.ops import MATMUL_OUTPUT
from qarl_jax.models.stacking import layer_runs

_INIT_STD = 0.02


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer, in the layout the backend's attention reads
    (:class:`kernels_pallas.attention.CacheLayout`, chosen at :meth:`init`): k, v [layers,
    batch(slots), max_len, kv_heads, head_dim] on the CPU and GPU; [layers, batch, kv_heads,
    padded length, padded head_dim] on a TPU, whose kernel reads a layer of it in place."""

    k: jax.Array
    v: jax.Array
    layout: CacheLayout
    # logical axes of the CPU/GPU layout's k and v: slots split like batch rows, heads like the
    # attention's heads (:attr:`axes`: any layout's)
    logical_axes: ClassVar[tuple[str | None, ...]] = (None, "batch", None, "kv_heads", None)

    @classmethod
    def init(cls, config: TransformerConfig, batch: int, max_len: int, dtype=None) -> KVCache:
        layout = cache_layout(max_len, config.head_dim)
        shape = layout.shape(config.num_hidden_layers, batch, config.cache_kv_heads)
        dtype = dtype or jnp.dtype(config.dtype)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), layout=layout)

    @property
    def max_len(self) -> int:
        return self.layout.max_len

    @property
    def axes(self) -> tuple[str | None, ...]:
        """The logical axes of k and v in this cache's layout."""
        return self.layout.axes("batch", "kv_heads")


def _param(module: nn.Module, name: str, shape, axes, dtype, init=None):
    """A parameter with logical axes. An existing value is returned as is: a frozen
    ``QuantizedWeight`` (packed int4, scales) legitimately differs from the float shape."""
    if module.has_variable("params", name):
        return nn.meta.unbox(module.get_variable("params", name))
    init = init or nn.initializers.normal(_INIT_STD)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class Dense(nn.Module):
    """A bias-free projection [.., K] -> [.., N] through the single quantization-aware matmul."""

    features: int
    kind: str  # attention | mlp | lm_head | router: selects the format in QuantSpec
    axes: tuple[str | None, str | None]
    config: TransformerConfig
    quant: quant.QuantSpec | None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = _param(
            self, "kernel", (x.shape[-1], self.features), self.axes, jnp.dtype(self.config.param_dtype)
        )
        spec, kind = self.quant, self.kind
        tp = ops.tensor_parallel()
        blocks = local_blocks(self.config, "lm_head", tp)
        x = x.astype(self.config.dtype)
        if tp is None:
            y = ops.per_device(
                lambda x, w: quant.dot(x, w, spec, kind, blocks), x, kernel, batched=(True, False)
            )
        else:  # this device's columns (blocks / tp.size of them); the caller's jit gathers them
            y = ops.per_device(
                lambda x, w: quant.dot(x, w, spec, kind, blocks),
                x,
                kernel,
                batched=(True, False),
                specs=(None, P(None, tp.axis)),
                out_specs=P(*(None,) * (x.ndim - 2), tp.axis),
            )
        if y.shape[-1] != self.features:  # an engine's lm_head padded to its degree (rollout.layout)
            y = y[..., : self.features]
        return checkpoint_name(y, MATMUL_OUTPUT)


class RMSNorm(nn.Module):
    dim: int
    eps: float
    param_dtype: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = _param(
            self, "scale", (self.dim,), ("norm",), jnp.dtype(self.param_dtype), nn.initializers.ones
        )
        return ops.rms_norm(x, scale, self.eps)


class _NormScale(nn.Module):
    """An RMSNorm's ``scale`` parameter (ones at init), for the fused per-token regions."""

    dim: int
    param_dtype: str

    @nn.compact
    def __call__(self) -> jax.Array:
        return _param(
            self, "scale", (self.dim,), ("norm",), jnp.dtype(self.param_dtype), nn.initializers.ones
        )


def _norm_weights(c: TransformerConfig, dim: int, name: str) -> dict:
    return {"scale": _NormScale(dim, c.param_dtype, name=name)()}


class AttentionWeights(nn.Module):
    """The attention's parameters: q/k/v/o projections, the q/k/v biases of a family that has them
    (Qwen2) and the q/k RMSNorm scales of one that has those (Qwen3)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self) -> dict:
        c = self.config
        h, kv, d = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.head_dim
        dt, bias = c.param_dtype, c.spec.qkv_bias
        weights = {
            "q_proj": _Projection((c.hidden_size, h), ("embed", "q_heads"), dt, bias, name="q_proj")(),
            "k_proj": _Projection((c.hidden_size, kv), ("embed", "kv_heads"), dt, bias, name="k_proj")(),
            "v_proj": _Projection((c.hidden_size, kv), ("embed", "kv_heads"), dt, bias, name="v_proj")(),
            "o_proj": _Projection((h, c.hidden_size), ("q_heads", "embed"), dt, False, name="o_proj")(),
        }
        if c.spec.qk_norm:
            weights.update(q_norm=_norm_weights(c, d, "q_norm"), k_norm=_norm_weights(c, d, "k_norm"))
        return weights


class MLPWeights(nn.Module):
    """The dense MLP's gate/up/down projections."""

    config: TransformerConfig

    @nn.compact
    def __call__(self) -> dict:
        c = self.config
        dt, hd, inter = c.param_dtype, c.hidden_size, c.intermediate_size
        return {
            "gate_proj": {"kernel": _Kernel((hd, inter), ("embed", "mlp"), dt, name="gate_proj")()},
            "up_proj": {"kernel": _Kernel((hd, inter), ("embed", "mlp"), dt, name="up_proj")()},
            "down_proj": {"kernel": _Kernel((inter, hd), ("mlp", "embed"), dt, name="down_proj")()},
        }


def fused_block_rows(c: TransformerConfig) -> int:
    """Tokens per block of a layer's fused per-token chains: a function of the layer's widths only
    (never of the number of tokens)."""
    widest = max(c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size)
    return fused.default_block_rows(widest)


def _fused(fn, rows, weights, c: TransformerConfig, spec: quant.QuantSpec | None, name: str, **specs):
    """``fn`` over the tokens of ``rows`` as one block program; master weights are quantized once,
    before the loop (the frozen ones pass as they are). ``specs``: ``ops.fused_tokens``' splits."""
    prepare = None if spec is None else (lambda w: quant.quantize_params(w, spec))
    return ops.fused_tokens(
        fn, rows, weights, block_rows=fused_block_rows(c), prepare=prepare, name=name, **specs
    )


def _column_specs(weights, tp: ops.TensorParallel | None, c: TransformerConfig) -> dict | None:
    """Per-device splits of a fused chain's weights: every projection kernel (float or frozen: values
    and scales alike) by columns over the tensor axis, norm scales whole; k_proj and v_proj whole
    when their heads are replicated (``c.kv_replicas`` > 1: each device computes its kv head's
    block, see :func:`_pre_attention`). None without ``tp``."""
    if tp is None:
        return None

    def spec(name: str, v):
        if isinstance(v, dict):
            if name in ("k_proj", "v_proj") and c.kv_replicas > 1:
                return jax.tree.map(lambda _: P(), v, is_leaf=lambda x: isinstance(x, quant.QuantizedWeight))
            return {k: spec(k, x) for k, x in v.items()}
        if name == "kernel":
            return P(None, tp.axis)
        return P(tp.axis) if name == "bias" else P()  # a bias follows its kernel's columns

    return {k: spec(k, v) for k, v in weights.items()}


def local_blocks(c: TransformerConfig, name: str, tp: ops.TensorParallel | None) -> int | None:
    """The column blocks of projection ``name`` this device computes, each its own materialised
    kernel call (:func:`qarl_jax.quant.dot`): all of them without ``tp``, its share with it (one
    block or more). None when the model is not column-blocked (``tensor_blocks`` 1): one plain call."""
    if c.tensor_blocks == 1:
        return None
    return c.column_blocks(name) // (1 if tp is None else tp.size)


def _dot(h, w, c: TransformerConfig, spec, kind: str, name: str, tp: ops.TensorParallel | None):
    """A chain's projection ``name`` in its column blocks (a tensor-parallel device: its share)."""
    return quant.dot(h, w, spec, kind, local_blocks(c, name, tp))


def _biased(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    """A projection's output plus its bias (Qwen2's q/k/v), added in the output's dtype as
    transformers' Linear adds it; y itself without one."""
    return y if bias is None else y + bias.astype(y.dtype)


def _rotate(y: jax.Array, norm: dict | None, positions, c: TransformerConfig) -> jax.Array:
    """q or k [N, heads, D] after its projection: the per-head RMSNorm (a family with q/k norms),
    then RoPE at the config's frequencies (theta's, or Llama 3's scaled ones)."""
    if norm is not None:
        y = rowwise.rms_norm(y, norm["scale"], c.rms_norm_eps)
    return rowwise.rope(y, positions, c.rope_theta, c.rope_inv_freq)


def _heads(h, p: dict, norm, positions, c: TransformerConfig, spec, name: str, tp: ops.TensorParallel | None):
    """q or k [N, heads, D]: the projection ``name`` (``p``: its kernel and bias), its per-head
    RMSNorm (``norm``, or None) and RoPE. In column blocks (``tensor_blocks`` > 1) each block's heads
    run these steps as one program of its own: a norm's reduction over more heads at once may sum
    in another order, so a device holding one block computes what the whole projection computes
    there; a bias is sliced with its block's columns."""
    n, d = h.shape[0], c.head_dim
    w, b = p["kernel"], p.get("bias")

    def block(x, wb, bb):
        return _rotate(_biased(quant.dot(x, wb, spec, "attention"), bb).reshape(n, -1, d), norm, positions, c)

    blocks = local_blocks(c, name, tp)
    if blocks is None:
        return block(h, w, b)
    width = (w.n if isinstance(w, quant.QuantizedWeight) else w.shape[-1]) // blocks
    cut = lambda a, i: None if a is None else quant.column_slice(a, i * width, width)  # noqa: E731
    slices = [lax.optimization_barrier((h, cut(w, i), cut(b, i))) for i in range(blocks)]
    return jnp.concatenate([block(*parts) for parts in slices], axis=1)


def _pre_attention(x, positions, w, c: TransformerConfig, spec: quant.QuantSpec | None, tp=None):
    """Per token: input RMSNorm, q/k/v projections (and biases), q/k RMSNorms, RoPE. x [N, H],
    positions [N] -> q [N, heads, D], k, v [N, kv_heads, D] (``tp``: this device's heads)."""
    n, d = x.shape[0], c.head_dim
    eps, a = c.rms_norm_eps, w["self_attn"]
    h = rowwise.rms_norm(x, w["input_layernorm"]["scale"], eps).astype(c.dtype)
    if spec is None or c.tensor_blocks == 1:  # one block: the projection, then norm and RoPE
        proj = lambda name: _biased(quant.dot(h, a[name]["kernel"], spec, "attention"), a[name].get("bias"))  # noqa: E731
        q, k, v = (proj(name).reshape(n, -1, d) for name in ("q_proj", "k_proj", "v_proj"))
        q, k = _rotate(q, a.get("q_norm"), positions, c), _rotate(k, a.get("k_norm"), positions, c)
        return q, _replicate_kv(k, c, tp), _replicate_kv(v, c, tp)
    kv_tp = None if c.kv_replicas > 1 else tp  # replicated kv heads: every device has every block
    q = _heads(h, a["q_proj"], a.get("q_norm"), positions, c, spec, "q_proj", tp)
    k = _heads(h, a["k_proj"], a.get("k_norm"), positions, c, spec, "k_proj", kv_tp)
    v = _dot(h, a["v_proj"]["kernel"], c, spec, "attention", "v_proj", kv_tp)
    v = _biased(v, a["v_proj"].get("bias")).reshape(n, -1, d)
    return q, _replicate_kv(k, c, tp), _replicate_kv(v, c, tp)


def _replicate_kv(x: jax.Array, c: TransformerConfig, tp: ops.TensorParallel | None) -> jax.Array:
    """k or v [N, kv_heads, D] as the attention reads them: each kv head repeated ``c.kv_replicas``
    times ([N, cache_kv_heads, D]); a tensor-parallel device keeps the copy of its block (device j:
    head j // kv_replicas), having computed every kv block on the whole k/v weights, as the
    training forward does (the same kernel calls, so the same bits)."""
    r = c.kv_replicas
    if r == 1:
        return x
    if tp is None:
        return jnp.repeat(x, r, axis=1)
    return lax.dynamic_slice_in_dim(x, lax.axis_index(tp.axis) // r, 1, axis=1)


def _post_attention(attn, x, w, c: TransformerConfig, spec: quant.QuantSpec | None, dense_mlp: bool, tp=None):
    """Per token: output projection and residual, post-attention RMSNorm and, for a dense layer,
    the MLP and its residual. attn [N, heads * D], x [N, H] -> (x', ) dense, (x', normed x') MoE.
    ``tp``: attn holds this device's heads and every projection its columns; each product is
    gathered whole (concatenated in device order) before the next step needs a whole row."""
    whole = (lambda y: y) if tp is None else tp.gather
    o = _dot(
        whole(attn.astype(c.dtype)), w["self_attn"]["o_proj"]["kernel"], c, spec, "attention", "o_proj", tp
    )
    x = x + whole(o)
    h = rowwise.rms_norm(x, w["post_attention_layernorm"]["scale"], c.rms_norm_eps)
    if not dense_mlp:
        return x, h
    m, hc = w["mlp"], h.astype(c.dtype)
    gate = _dot(hc, m["gate_proj"]["kernel"], c, spec, "mlp", "gate_proj", tp)
    up = _dot(hc, m["up_proj"]["kernel"], c, spec, "mlp", "up_proj", tp)
    act = whole((nn.silu(gate) * up).astype(c.dtype))
    return (x + whole(_dot(act, m["down_proj"]["kernel"], c, spec, "mlp", "down_proj", tp)),)


class _Kernel(nn.Module):
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    param_dtype: str

    @nn.compact
    def __call__(self) -> jax.Array:
        return _param(self, "kernel", self.shape, self.axes, jnp.dtype(self.param_dtype))


class _Projection(nn.Module):
    """A projection's parameters: ``kernel`` [K, N] and, with ``bias``, ``bias`` [N] on the kernel's
    column axis (zeros at init; never quantized: only ``kernel`` leaves are, see
    :func:`qarl_jax.quant.kind_of`)."""

    shape: tuple[int, int]
    axes: tuple[str | None, str | None]
    param_dtype: str
    bias: bool

    @nn.compact
    def __call__(self) -> dict:
        dtype = jnp.dtype(self.param_dtype)
        out = {"kernel": _param(self, "kernel", self.shape, self.axes, dtype)}
        if self.bias:
            out["bias"] = _param(self, "bias", self.shape[-1:], self.axes[-1:], dtype, nn.initializers.zeros)
        return out


class ExpertWeights(nn.Module):
    """The experts' stacked projections gate_proj, up_proj, down_proj: kernels [E, K, N]."""

    config: TransformerConfig

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        c = self.config
        e, hdim, inter = c.num_experts, c.hidden_size, c.moe_intermediate_size
        up_axes, down_axes = ("experts", "embed", "expert_mlp"), ("experts", "expert_mlp", "embed")
        return (
            _Kernel((e, hdim, inter), up_axes, c.param_dtype, name="gate_proj")(),
            _Kernel((e, hdim, inter), up_axes, c.param_dtype, name="up_proj")(),
            _Kernel((e, inter, hdim), down_axes, c.param_dtype, name="down_proj")(),
        )


class MoE(nn.Module):
    """Top-k routed experts (:func:`qarl_jax.models.moe.moe`), per device. On a mesh whose "experts"
    rule names an axis of more than one device, each device keeps only its experts (expert
    parallel); otherwise it computes every expert on the gathered weights."""

    config: TransformerConfig
    quant: quant.QuantSpec | None

    @nn.compact
    def __call__(self, x):
        c = self.config
        router = _Kernel((c.hidden_size, c.num_experts), ("embed", None), c.param_dtype, name="router")()
        weights = ExpertWeights(c, name="experts")()
        axis = _expert_axis(c)
        expert_spec = P() if axis is None else P(axis)
        split = axis is not None and x.shape[0] % sharding.batch_ways(jax.sharding.get_abstract_mesh()) == 0
        out, experts = ops.per_device(
            lambda x, r, w: moe.moe(x, r, w, c, self.quant, axis, split),
            x,
            router,
            weights,
            batched=(True, False, False),
            specs=(None, P(), expert_spec),
        )
        # the router's choices [B, T, top_k], kept only when "intermediates" is mutable (alignment
        # tools compare the rollout's and the training forward's routing); otherwise a no-op
        self.sow("intermediates", "router_topk", experts)
        return out


def _expert_axis(c: TransformerConfig) -> str | None:
    """The mesh axis the experts are split over (expert parallel), or None (every device computes
    every expert): the active rules' axis for "experts" when it is one axis of > 1 devices that
    divides the experts and also splits the batch rows."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:
        return None
    axes = sharding.mesh_axis_names(nn.logical_to_mesh_axes(("experts",))[0])  # type: ignore[index]
    if len(axes) != 1 or mesh.shape[axes[0]] == 1 or c.num_experts % mesh.shape[axes[0]]:
        return None
    return axes[0] if axes[0] in sharding.batch_axes() else None


class DecoderLayer(nn.Module):
    """One decoder layer in scan form: ``(carry, positions, starts, segment_ids) -> (carry, None)``
    with carry ``(x, cache)``; cache is None (full-sequence forward) or ``(kv, i)``: the whole
    stacked :class:`KVCache` and this layer's index in it (the next layer's on the way out). The
    same module runs unrolled (``layers_{i}``) or under ``nn.scan``."""

    config: TransformerConfig
    layer: int  # its index (the first of its run when scanned: only its kind matters)
    quant: quant.QuantSpec | None

    @nn.compact
    def __call__(self, carry, positions, starts, segment_ids):
        x, layer_cache = carry
        c = self.config
        b, t, _ = x.shape
        dense_mlp = not c.is_moe_layer(self.layer)
        tp = ops.tensor_parallel()  # the rollout engine's tensor-parallel layout, else None
        heads = None if tp is None else P(None, tp.axis, None)
        attn_w = AttentionWeights(c, name="self_attn")()
        pre = {"input_layernorm": _norm_weights(c, c.hidden_size, "input_layernorm"), "self_attn": attn_w}
        q, k, v = _fused(
            lambda x, p, w: _pre_attention(x, p, w, c, self.quant, tp),
            (x, positions),
            pre,
            c,
            self.quant,
            "pre_attention",
            weight_specs=_column_specs(pre, tp, c),
            out_specs=None if tp is None else (heads, heads, heads),
        )
        q, k, v = (checkpoint_name(a, MATMUL_OUTPUT) for a in (q, k, v))
        visibility = Visibility(positions, starts, segment_ids, segment_ids)  # packed rows: S == T
        if layer_cache is not None:  # write this step's K/V at their positions, attend over the cache
            cache, i = layer_cache  # the whole stacked cache, written in place at layer i
            layout = cache.layout
            if layout.heads_first:  # the TPU kernel reads layer i of the stack where it lies
                out, (ck, cv) = ops.cached_attention(q, k, v, (cache.k, cache.v), i, positions, layout, tp)
            else:
                ck, cv = layout.write(cache.k, i, positions, k), layout.write(cache.v, i, positions, v)
                out = ops.attention(q, ck[i].astype(q.dtype), cv[i].astype(q.dtype), visibility, tp)
            layer_cache = (KVCache(ck, cv, layout), i)
        else:
            out = ops.attention(q, k.astype(q.dtype), v.astype(q.dtype), visibility, tp)
        out = nn.with_logical_constraint(out.reshape(b, t, -1), ("batch", "length", "act_heads"))
        post = {
            "self_attn": {"o_proj": attn_w["o_proj"]},
            "post_attention_layernorm": _norm_weights(c, c.hidden_size, "post_attention_layernorm"),
        }
        if dense_mlp:
            post["mlp"] = MLPWeights(c, name="mlp")()
        outs = _fused(
            lambda a, x, w: _post_attention(a, x, w, c, self.quant, dense_mlp, tp),
            (out, x),
            post,
            c,
            self.quant,
            "post_attention",
            row_specs=None if tp is None else (P(None, tp.axis), None),
            weight_specs=_column_specs(post, tp, c),
        )
        x = checkpoint_name(outs[0], MATMUL_OUTPUT)
        if not dense_mlp:
            x = x + MoE(c, self.quant, name="mlp")(outs[1])
        if c.scan_layers:  # a scan's carry keeps its type (plain XLA matmuls promote to the params')
            x = x.astype(carry[0].dtype)
        if layer_cache is not None:
            layer_cache = (layer_cache[0], layer_cache[1] + 1)
        return (nn.with_logical_constraint(x, ("batch", "length", "act_embed")), layer_cache), None


class Qwen3ForCausalLM(nn.Module):
    """Qwen3 / Qwen3-MoE causal LM. ``quant=None`` runs plain XLA matmuls (the HF-parity path)."""

    config: TransformerConfig
    quant: quant.QuantSpec | None = None
    remat: bool = False  # recompute each layer's activations in the backward pass (long sequences)

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(
            c.vocab_size,
            c.hidden_size,
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(_INIT_STD), ("vocab", "embed")
            ),
            param_dtype=jnp.dtype(c.param_dtype),
            dtype=jnp.dtype(c.dtype),
        )
        layer = _layer_class(c, self.remat)
        if c.scan_layers:
            self.stack = {
                f"{start}_{stop}": nn.scan(
                    layer,
                    variable_axes={"params": 0, "intermediates": 0},
                    split_rngs={"params": True},
                    in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                    length=stop - start,
                    metadata_params={nn.PARTITION_NAME: "layers"},
                )(c, start, self.quant)
                for start, stop in layer_runs(c)
            }
        else:
            self.layers = [layer(c, i, self.quant) for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.param_dtype)
        if not c.tie_word_embeddings:
            self.lm_head = Dense(c.vocab_size, "lm_head", ("embed", "vocab"), c, self.quant)

    def head(self, x: jax.Array) -> jax.Array:
        """lm_head logits [..., V] of final-norm hidden states ``x`` [..., H]. Row-wise (the matmul
        kernel's rows are independent), so a caller may run it over any split of the tokens."""
        if self.config.tie_word_embeddings:
            spec = self.quant
            blocks = local_blocks(self.config, "lm_head", None)  # the table stays whole: all blocks
            return ops.per_device(
                lambda x, w: quant.dot(x, w.T, spec, "lm_head", blocks),
                x,
                self.embed_tokens.embedding,
                batched=(True, False),
            )
        return self.lm_head(x)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ):
        """Full-sequence forward. tokens [B, T]; positions default to 0..T-1; segment_ids [B, T]
        mark packed sequences (0 = padding): a token attends to earlier tokens of its own segment."""
        return self.head(self.hidden(tokens, positions, segment_ids))

    def hidden(
        self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        """The full-sequence forward up to the final norm: [B, T, H], what :meth:`head` maps to
        logits (the trainer's loss applies the head in chunks of tokens)."""
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        # a packed sequence's position 0 sits at row index t - position: its key blocks start there
        starts = jnp.arange(t, dtype=jnp.int32)[None, :] - positions.astype(jnp.int32)
        x = nn.with_logical_constraint(self.embed_tokens(tokens), ("batch", "length", "act_embed"))
        x, _ = self._decoder(x, None, positions, starts, segment_ids)
        return self.norm(x)

    def _decoder(self, x, cache, positions, starts, segment_ids):
        """Every layer in order (unrolled or one scan per run); cache as in :class:`DecoderLayer`."""
        carry = (x, cache)
        if self.config.scan_layers:
            for start, stop in layer_runs(self.config):
                if cache is not None:  # the run's scan counts its layer index from its first layer
                    carry = (carry[0], (carry[1][0], jnp.int32(start)))
                carry, _ = self.stack[f"{start}_{stop}"](carry, positions, starts, segment_ids)
            return carry
        for layer in self.layers:
            carry, _ = layer(carry, positions, starts, segment_ids)
        return carry

    def decode(self, tokens: jax.Array, positions: jax.Array, cache: KVCache):
        """Incremental forward over a KV cache (prefill when T > 1, one decode step when T == 1).

        Each row is one sequence (a rollout slot); token t of row b sits at positions[b, t] and
        attends to every cached position <= its own. Positions >= cache length are dropped."""
        hidden, cache = self.decode_hidden(tokens, positions, cache)
        return self.head(hidden), cache

    def decode_hidden(self, tokens: jax.Array, positions: jax.Array, cache: KVCache):
        """:meth:`decode` up to the final norm: (hidden [B, T, H], cache), for callers that need
        the logits of a few positions only (a prefill needs its last prompt token's)."""
        x = self.embed_tokens(tokens)
        x, (cache, _) = self._decoder(x, (cache, 0), positions, None, None)
        return self.norm(x), cache


def _layer_class(c: TransformerConfig, remat: bool) -> type[nn.Module]:
    """DecoderLayer, rematerialised by ``c.remat_policy`` when ``remat``. A scanned layer skips
    remat's CSE barriers: the scan's loop already keeps the recomputation from being merged."""
    if not remat or c.remat_policy == "none":
        return DecoderLayer
    policy = None
    if c.remat_policy == "save_dots":
        policy = jax.checkpoint_policies.save_only_these_names(MATMUL_OUTPUT)
    return nn.remat(DecoderLayer, policy=policy, prevent_cse=not c.scan_layers)


def init_fn(model: Qwen3ForCausalLM):
    """rng -> params (plain arrays). Always run under jit: the same program whether or not it is
    sharded, so sharded and single-device inits give the same bits."""
    return lambda rng: nn.meta.unbox(model.init(rng, jnp.zeros((1, 1), jnp.int32))["params"])


def init_params(model: Qwen3ForCausalLM, rng: jax.Array) -> dict:
    """Single-device parameter init. See :func:`init_sharded` for meshes."""
    return jax.jit(init_fn(model))(rng)


def init_sharded(model: Qwen3ForCausalLM, rng: jax.Array, mesh: Mesh, rules=sharding.DEFAULT_RULES) -> dict:
    """Initialise parameters directly in their shards (no device ever holds the whole model)."""
    return jax.jit(init_fn(model), out_shardings=sharding.param_shardings(model, mesh, rules))(rng)
