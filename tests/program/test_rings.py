"""Ring caches: the pass that gives sliding layers rings of their window (``linnet.program.rings``)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from checkpoints import CASES_BY_ID, hf_config

from linnet.errors import LinnetError
from linnet.program import Op, build_program, format_program, infer_types
from linnet.program.rings import ring_caches, ring_slots, rings
from linnet.spec import spec_from_hf_config


def spec(case: str, **config):
    """A case's spec, read from its config.json alone (transformers' default rope_theta where it has none)."""
    return spec_from_hf_config({"rope_theta": 10000.0, **hf_config(CASES_BY_ID[case]), **config})


GEMMA2 = spec("gemma2-softcap-window6")  # sliding over 6, then full
LLAMA = spec("llama-gqa3")


def gemma3_shape(layers: int = 6, window: int = 1024, positions: int = 8192):
    """Gemma 3's pattern: five sliding layers to each global one."""
    return spec("gemma3-local-rope", num_hidden_layers=layers, sliding_window=window, max_position_embeddings=positions,
                layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6))


def test_gemma3_at_8192_positions_holds_under_a_third_of_the_full_cache():
    program = build_program(gemma3_shape(), "bf16")
    ringed = ring_caches(program, 8192, 256, 8192)
    full = program.cache_bytes_per_row(8192)
    assert full == 2 * 6 * 2 * 16 * 8192 * 2  # keys and values, 6 layers, 2 KV heads of 16, bf16
    assert ringed.cache_bytes_per_row(8192) == full * (5 * (1024 + 255) + 8192) // (6 * 8192)
    assert 0.29 < ringed.cache_bytes_per_row(8192) / full < 0.30
    assert rings(ringed) == {(1279, 1024)}


def test_sliding_kinds_get_rings_and_the_others_stay_as_they_are():
    ringed = ring_caches(build_program(GEMMA2), positions=64, chunk=4, scratch=64)
    assert ringed.ring("sliding") == 9 and ringed.ring("full") is None  # window 6 + chunk 4 - 1
    assert ringed.kinds["full"] == build_program(GEMMA2).kinds["full"]
    writes = [op for op in ringed.kinds["sliding"].ops if op.kind == "cache_write"]
    assert [op.attrs for op in writes] == [{"ring": 9, "scratch": 64}] * 2
    (attention,) = [op for op in ringed.kinds["sliding"].ops if op.kind == "attention"]
    assert attention.attrs["ring"] == 9 and attention.attrs["window"] == 6
    types = infer_types(ringed)
    assert types["layer.sliding"]["cache_k"].shape == ("ROWS", 2, 10, 16)  # the slots and the scratch slot
    assert types["layer.full"]["cache_k"].shape == ("ROWS", 2, "P", 16)
    assert "cache_k: f32[ROWS, 2, 10, 16]" in format_program(ringed)
    assert [ringed.cache_slots(kind, 64) for kind in ringed.layer_kinds] == [10, 65]


def test_no_ring_where_it_would_hold_as_many_positions_as_the_cache():
    assert ring_slots(6, 4, 10) == 9 and ring_slots(6, 4, 9) is None
    program = build_program(GEMMA2)
    assert ring_caches(program, positions=9, chunk=4, scratch=9) == program
    assert ring_caches(build_program(LLAMA), positions=64, chunk=4, scratch=64) == build_program(LLAMA)


def test_a_ring_op_on_a_cache_of_another_size_is_an_error():
    ringed = ring_caches(build_program(GEMMA2), positions=64, chunk=4, scratch=64)
    sliding = ringed.kinds["sliding"]
    ops = tuple(Op(op.kind, op.outs, op.inputs, {**op.attrs, "ring": 8}) if op.kind == "attention" else op
                for op in sliding.ops)
    with pytest.raises(LinnetError, match="a ring is a positive number of slots"):
        infer_types(replace(ringed, kinds={**ringed.kinds, "sliding": replace(sliding, ops=ops)}))
