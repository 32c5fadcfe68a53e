"""The Linnet program: typed single-assignment values, and its backend-neutral passes."""
from __future__ import annotations

from dataclasses import replace

import pytest
from checkpoints import CASES_BY_ID, hf_config

from linnet.errors import LinnetError
from linnet.program import Op, Value, build_program, fold_norm_weights, fuse_norm_linears, fuse_projections, infer_types
from linnet.spec import spec_from_hf_config

QWEN2 = spec_from_hf_config(hf_config(CASES_BY_ID["qwen2-tied"]))  # qkv bias, tied
QWEN3 = spec_from_hf_config(hf_config(CASES_BY_ID["qwen3-gqa3"]))  # q/k norm, head_dim 32 != 48 / 6


def kinds(ops: tuple[Op, ...]) -> list[str]:
    return [op.kind for op in ops]


def all_passes(spec):
    return fold_norm_weights(fuse_norm_linears(fuse_projections(build_program(spec))))


@pytest.mark.parametrize("spec", [QWEN2, QWEN3], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("passes", [build_program, all_passes], ids=["plain", "passes"])
def test_every_value_is_assigned_once_and_typed(spec, passes):
    program = passes(spec)
    types = infer_types(program)
    for name, section in program.sections().items():
        outs = [o for op in section.ops for o in op.outs]
        assert len(outs) == len(set(outs)), f"{name} reassigns a value"
        assert all(o not in section.params for o in outs)
        assert all(isinstance(types[name][o], Value) for o in outs)
    layer = types["layer"]
    assert layer["q_rot"] == Value(("R", "T", spec.num_heads, spec.head_dim), "f32")
    assert layer["cache_k_out"] == Value(("ROWS", spec.num_kv_heads, "P", spec.head_dim), "f32")
    assert layer["attn"].shape == ("R", "T", spec.num_heads * spec.head_dim)  # head_dim, not hidden / heads
    assert types["head"]["logits"] == Value(("R", "S", spec.vocab_size), "f32")


def test_run_dtype_types_activations_and_logits_stay_f32():
    types = infer_types(build_program(QWEN3, "bf16"))
    assert types["layer"]["x_out"].dtype == "bf16" and types["head"]["logits"].dtype == "f32"
    assert types["layer"]["w.q"] == Value((QWEN3.q_size, QWEN3.hidden_size), "bf16")


def test_the_cache_is_an_input_and_an_output_of_the_layer():
    layer = build_program(QWEN2).layer
    assert layer.params == ("x", "cache_k", "cache_v")
    assert layer.results == ("x_out", "cache_k_out", "cache_v_out")
    writes = [op for op in layer.ops if op.kind == "cache_write"]
    attention = next(op for op in layer.ops if op.kind == "attention")
    assert {w.outs[0] for w in writes} <= set(attention.inputs)  # attention reads the written cache


def with_layer_ops(program, ops):
    return replace(program, kinds={"full": replace(program.layer, ops=ops)})


def test_broken_programs_are_refused_by_name():
    program = build_program(QWEN2)
    twice = with_layer_ops(program, program.layer.ops + (Op("add", ("h",), ("x", "x")),))
    with pytest.raises(LinnetError, match="'h' is assigned twice"):
        infer_types(twice)
    unknown = with_layer_ops(program, (Op("add", ("y",), ("x", "nope")),))
    with pytest.raises(LinnetError, match="reads 'nope' before it is assigned"):
        infer_types(unknown)
    misshapen = with_layer_ops(program, (Op("linear", ("y",), ("x", "w.down")),))
    with pytest.raises(LinnetError, match="in-size must match"):
        infer_types(misshapen)


def test_norm_before_each_fused_projection_becomes_norm_linear():
    program = fuse_norm_linears(fuse_projections(build_program(QWEN2)))
    assert kinds(program.layer.ops) == [
        "norm_linear", "split", "split_heads", "split_heads", "split_heads", "rotary", "rotary",
        "cache_write", "cache_write", "attention", "linear", "add", "norm_linear", "split", "swiglu", "linear", "add",
    ]
    qkv, gate_up = (op for op in program.layer.ops if op.kind == "norm_linear")
    assert qkv.inputs == ("x", "w.attn_norm", "w.qkv", "w.qkv_bias") and qkv.outs == ("qkv",)
    assert gate_up.inputs == ("x_attn", "w.mlp_norm", "w.gate_up") and gate_up.attrs == {"eps": 1e-6}
    split = program.layer.ops[1]
    assert split.outs == ("q", "k", "v") and split.attrs["sizes"] == (QWEN2.q_size, QWEN2.kv_size, QWEN2.kv_size)
    assert kinds(program.head.ops) == ["select", "norm_linear", "cast"]


def test_qk_norms_stay_norms():
    program = fuse_norm_linears(fuse_projections(build_program(QWEN3)))
    norms = [op for op in program.layer.ops if op.kind == "rms_norm"]
    assert [op.inputs[1] for op in norms] == ["w.q_norm", "w.k_norm"]


def test_norm_read_by_several_linears_is_left_alone():
    # Without projection fusion, the norm's output feeds q, k and v: scaling after one product would be wrong.
    program = build_program(QWEN2)
    assert kinds(fuse_norm_linears(program).layer.ops).count("norm_linear") == 0
    assert fuse_norm_linears(program).layer.ops[:4] == program.layer.ops[:4]


def test_norm_weights_fold_into_the_matrices_after_them():
    program = all_passes(QWEN2)
    assert kinds(program.layer.ops).count("rms_linear") == 2 and "norm_linear" not in kinds(program.layer.ops)
    assert program.layer.ops[0] == Op("rms_linear", ("qkv",), ("x", "w.qkv", "w.qkv_bias"), {"eps": 1e-6})
    # A tied head's matrix is the embedding too: its norm weight stays an input.
    assert program.head.ops[1] == Op("rms_linear", ("logits_act",), ("x_sel", "w.lm_head", "w.norm"),
                                     {"eps": 1e-6, "norm": True})
    assert program.folded == (("layer", "qkv", "attn_norm"), ("layer", "gate_up", "mlp_norm"))
    untied = fold_norm_weights(fuse_norm_linears(build_program(QWEN3)))
    assert untied.head.ops[1] == Op("rms_linear", ("logits_act",), ("x_sel", "w.lm_head"), {"eps": 1e-6})
    assert untied.folded[-1] == ("head", "lm_head", "norm")


def test_program_text_names_every_value_with_its_type():
    text = str(all_passes(QWEN3))
    assert "step(tokens: i64[R, T], positions: i64[R, T], rows: i64[R], select: i64[R, S]" in text
    assert "q_rot = rotary(q_normed, positions, rope_cos, rope_sin)    # f32[R, T, 6, 32]" in text
    assert "qkv = concat(q, k, v)" in text and "head: lm_head *= norm (columns)" in text
