"""Linnet's own StableHLO: weights are arguments, never constants, and a module XLA rejects is an error that
names the module's entry point and the op (with the Program op it lowers); an attribute neither XLA emitter
knows is an error, never ignored."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest

from linnet.backends.xla.codegen import generate_source
from linnet.backends.xla.layout import xla_program
from linnet.backends.xla.stablehlo import Sizes, emit_module
from linnet.backends.xla.stablehlo_runner import compile_module
from linnet.errors import LinnetError
from linnet.spec import spec_from_hf_config

SPEC = spec_from_hf_config({
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 48, "intermediate_size": 104, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 331, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True,
})
DECODE = Sizes(R=2, T=1, S=1, ROWS=2, P=65)


def test_weights_are_arguments_and_constants_scalars():
    text = emit_module(xla_program(SPEC), DECODE, "decode")
    assert "%layers.1.qkv: tensor<96x48xf32>" in text  # q, k, v of 4 + 2 + 2 heads of 12
    constants = re.findall(r"stablehlo\.constant dense<[^>]*> : (tensor<[^>]*>)", text)
    assert constants and set(constants) <= {"tensor<f32>", "tensor<i32>"}


def test_a_module_xla_rejects_names_the_entry_point_and_the_op():
    text = emit_module(xla_program(SPEC), DECODE, "decode")
    broken = text.replace("contracting_dims = [2] x [1]", "contracting_dims = [2] x [0]", 1)  # the first product
    compile_module(text, "decode")  # the module as emitted compiles
    with pytest.raises(LinnetError, match=r"^XLA rejected the StableHLO module 'decode' at stablehlo\.dot_general "
                                          r"\(layer 0: qkv = rms_linear \(%v\d+\)\): "
                                          r"contracting dimension sizes must match"):
        compile_module(broken, "decode")


def with_attention_attr(program, **attrs):
    """``program`` with extra attrs on its attention op."""
    layer = program.layer
    ops = tuple(replace(op, attrs={**op.attrs, **attrs}) if op.kind == "attention" else op for op in layer.ops)
    return replace(program, kinds={kind: replace(layer, ops=ops) for kind in program.kinds})


def test_an_attention_attribute_the_emitters_do_not_know_is_an_error_naming_it():
    program = with_attention_attr(xla_program(SPEC), sink=True)
    with pytest.raises(LinnetError, match="xla:stablehlo backend has no attention attribute sink"):
        emit_module(program, DECODE, "decode")
    with pytest.raises(LinnetError, match="xla:jax backend has no attention attribute sink"):
        generate_source(program)
