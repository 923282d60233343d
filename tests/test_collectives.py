"""collective_bytes: the bytes a compiled program's collectives deliver to one device per call,
loops counted once per iteration. Hand-derived figures on programs whose collectives are written
out (shard_map), and on HLO text with nested loops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from qarl_jax.tools.collectives import collective_bytes, collective_bytes_by_kind


def test_collectives_in_a_scan_count_once_per_layer():
    """6 layers, each gathering its [16, 64] f32 shard from 4 devices ([64, 64]: 16,384 bytes),
    then one psum of [8, 64] f32 (2,048 bytes) after the loop."""
    mesh = jax.make_mesh((4,), ("x",))

    def per_device(w, h):
        def layer(h, wl):
            return jnp.tanh(h @ jax.lax.all_gather(wl, "x", axis=0, tiled=True)), None

        h, _ = jax.lax.scan(layer, h, w)
        return jax.lax.psum(h, "x")

    f = jax.shard_map(per_device, mesh=mesh, in_specs=(P(None, "x"), P()), out_specs=P(), check_vma=False)
    w = jax.ShapeDtypeStruct((6, 64, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "x")))
    h = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
    text = jax.jit(f).lower(w, h).compile().as_text()
    assert collective_bytes_by_kind(text) == {"all-gather": 6 * 64 * 64 * 4, "all-reduce": 8 * 64 * 4}
    assert collective_bytes(text) == 6 * 16384 + 2048


def test_nested_loops_calls_and_async_pairs():
    """An all-gather-start/done pair in a loop of 3 inside a loop of 4 (12 runs, the done's
    [2, 8] bf16: 32 bytes each), a tuple-shaped all-to-all in a called computation (8 + 4 s8 bytes
    + 16 s4 nibbles: 20 bytes), and an all-reduce the entry runs once (u32[5]: 20 bytes)."""
    text = """
HloModule m

%inner (p: (s32[], bf16[2,8])) -> (s32[], bf16[2,8]) {
  %ags = (bf16[1,8]{1,0}, bf16[2,8]{1,0}) all-gather-start(%x), dimensions={0}
  %agd = bf16[2,8]{1,0} all-gather-done(%ags)
}

%outer (p: (s32[], bf16[2,8])) -> (s32[], bf16[2,8]) {
  %w = (s32[], bf16[2,8]) while(%t), condition=%c, body=%inner, backend_config={"known_trip_count":{"n":"3"}}
}

%helper (a: s8[8]) -> (s8[8], s8[4], s4[16]) {
  ROOT %a2a = (s8[8]{0}, s8[4]{0}, s4[16]{0}) all-to-all(%a, %b, %c), dimensions={0}
}

ENTRY %main (x: bf16[2,8]) -> bf16[2,8] {
  %w = (s32[], bf16[2,8]) while(%t), condition=%c, body=%outer, backend_config={"known_trip_count":{"n":"4"}}
  %c = (s8[8], s8[4], s4[16]) call(%a), to_apply=%helper
  ROOT %ar = u32[5]{0} all-reduce(%y), to_apply=%add
}
"""
    assert collective_bytes_by_kind(text) == {"all-gather": 12 * 32, "all-to-all": 20, "all-reduce": 20}


def test_a_collective_in_a_loop_of_unknown_trip_count_is_an_error():
    text = """
%body (p: f32[4]) -> f32[4] {
  %ag = f32[4]{0} all-gather(%p), dimensions={0}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  ROOT %w = f32[4] while(%x), condition=%c, body=%body
}
"""
    with pytest.raises(ValueError, match="all-gather in body runs in a loop of unknown trip count"):
        collective_bytes(text)
    assert collective_bytes(text, unknown_trips=3) == 3 * 16  # the caller's count: 3 x f32[4]
    with pytest.raises(ValueError, match="no ENTRY computation"):
        collective_bytes("%f (x: f32[1]) -> f32[1] {\n}")


def test_a_loop_without_a_trip_count_is_counted_from_its_counter():
    """XLA:TPU's unrolled loops (``wide.*``) carry no known_trip_count: the count comes from the
    loop itself, counter from 2 (through a copy) by steps of 3 while < 11: 2, 5, 8 -> 3 trips."""
    text = """
%cond (p: (s32[], f32[4])) -> pred[] {
  %n = s32[] constant(11)
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%wide.body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %i2 = s32[] copy(%i)
  %step = s32[] constant(3)
  %next = s32[] add(%i2, %step)
  %x = f32[4] get-tuple-element(%p), index=1
  %ag = f32[4]{0} all-gather(%x), dimensions={0}
  ROOT %t = (s32[], f32[4]) tuple(%next, %ag)
}

ENTRY %main (x: f32[4]) -> (s32[], f32[4]) {
  %zero = s32[] constant(2)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[4]) tuple(%start, %x)
  ROOT %w = (s32[], f32[4]) while(%init), condition=%cond, body=%wide.body
}
"""
    assert collective_bytes(text) == 3 * 16
    # the same loop counting down is not of the form read: still an error, never a guess
    with pytest.raises(ValueError, match="unknown trip count"):
        collective_bytes(text.replace("direction=LT", "direction=GT"))
