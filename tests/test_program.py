"""The Linnet program and its backend-neutral passes (projection fusion, norm + linear fusion, norm folding)."""
from __future__ import annotations

from linnet.program import Op, build_program, fold_norm_weights, fuse_norm_linears, fuse_projections
from linnet.spec import spec_from_hf_config
from checkpoints import CASES_BY_ID, hf_config

QWEN2 = spec_from_hf_config(hf_config(CASES_BY_ID["qwen2-tied"]))  # qkv bias
QWEN3 = spec_from_hf_config(hf_config(CASES_BY_ID["qwen3-gqa3"]))  # q/k norm


def kinds(ops: tuple[Op, ...]) -> list[str]:
    return [op.kind for op in ops]


def test_norm_before_each_fused_projection_becomes_norm_linear():
    program = fuse_norm_linears(fuse_projections(build_program(QWEN2)))
    assert kinds(program.layer) == [
        "norm_linear", "split", "split_heads", "split_heads", "split_heads", "rotary", "rotary",
        "attention", "linear", "add", "norm_linear", "split", "swiglu", "linear", "add",
    ]
    qkv, gate_up = (op for op in program.layer if op.kind == "norm_linear")
    assert qkv.inputs == ("x", "w.attn_norm", "w.qkv", "w.qkv_bias") and qkv.out == "qkv"
    assert gate_up.inputs == ("x", "w.mlp_norm", "w.gate_up") and gate_up.attrs == {"eps": 1e-6}
    assert program.head == (Op("norm_linear", "logits", ("x", "w.norm", "w.lm_head"), {"eps": 1e-6}),)


def test_qk_norms_stay_norms():
    program = fuse_norm_linears(fuse_projections(build_program(QWEN3)))
    norms = [op for op in program.layer if op.kind == "rms_norm"]
    assert [op.inputs[1] for op in norms] == ["w.q_norm", "w.k_norm"]


def test_norm_read_by_several_linears_is_left_alone():
    # Without projection fusion, the norm's output feeds q, k and v: scaling after one product would be wrong.
    program = build_program(QWEN2)
    assert fuse_norm_linears(program).layer[:4] == program.layer[:4]
    assert kinds(fuse_norm_linears(program).layer).count("norm_linear") == 0


def test_norm_weights_fold_into_the_matrices_after_them():
    program = fold_norm_weights(fuse_norm_linears(fuse_projections(build_program(QWEN2))))
    assert kinds(program.layer).count("rms_linear") == 2 and "norm_linear" not in kinds(program.layer)
    qkv = program.layer[0]
    assert qkv == Op("rms_linear", "qkv", ("x", "w.qkv", "w.qkv_bias"), {"eps": 1e-6})
    # A tied head's matrix is the embedding too: its norm weight stays apart.
    assert program.head == (Op("rms_linear", "logits", ("x", "w.lm_head"), {"eps": 1e-6, "norm": "w.norm"}),)
    assert program.folded == (("layer", "qkv", "attn_norm"), ("layer", "gate_up", "mlp_norm"))
    untied = fold_norm_weights(fuse_norm_linears(build_program(QWEN3)))
    assert untied.head == (Op("rms_linear", "logits", ("x", "w.lm_head"), {"eps": 1e-6}),)
    assert untied.folded[-1] == ("head", "lm_head", "norm")
