"""The ort variant's rewrites (``linnet.backends.onnx.passes``): each applies where its docstring says, leaves
the graph alone elsewhere, and changes no number: a graph with the passes and one without give ONNX Runtime's
same logits."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

from linnet.backends.onnx import graph
from linnet.backends.onnx.export import onnx_program, planned_arrays, write_graphs
from linnet.backends.onnx.graph import GraphOptions, build_graph
from linnet.backends.onnx.passes import GraphFacts, rotary_into_group_query_attention, skip_norms
from linnet.model import open_model

TOKENS = [5, 17, 101, 42, 250, 7]
CACHE_POSITIONS = 16


def op_types(model) -> list[str]:
    return [node.op_type for node in model.graph.node]


def built(weights, options: GraphOptions, dtype: str = "f32"):
    program = onnx_program(weights.spec, dtype)
    shapes = {name: array.shape for name, array in planned_arrays(weights, program).items()}
    return build_graph(program, shapes, CACHE_POSITIONS + 1, options)[0]


def prefill_logits(weights, options: GraphOptions, directory) -> np.ndarray:
    """The prompt's logits on one cache row (row 0, which GroupQueryAttention reads as bound)."""
    program = onnx_program(weights.spec, "f32")
    directory.mkdir()
    write_graphs(program, planned_arrays(weights, program), directory, CACHE_POSITIONS + 1,
                 {"model.onnx": options})
    session = ort.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    spec, t = weights.spec, len(TOKENS)
    feeds = {"tokens": np.array([TOKENS]), "positions": np.arange(t)[None], "rows": np.array([0]),
             "select": np.arange(t)[None]}
    for i in range(spec.num_layers):
        cache = np.zeros((1, spec.num_kv_heads, CACHE_POSITIONS, spec.head_dim), np.float32)
        feeds[f"cache_k.{i}"], feeds[f"cache_v.{i}"] = cache, cache.copy()
    return session.run(["logits"], feeds)[0]


@pytest.mark.parametrize("case", ["llama-gqa3", "gemma2-softcap-window6"])
def test_the_passes_change_the_nodes_and_not_the_logits(checkpoint_dir, tmp_path, monkeypatch, case):
    """Each norm after the residual add takes the add in; GroupQueryAttention takes in the split of the
    fused q/k/v product and both rotations (full rotary, nothing between). Without the passes: none of it,
    and the same logits."""
    weights = open_model(str(checkpoint_dir(case))).weights
    options = GraphOptions("ort", attention="gqa")
    with_passes = op_types(built(weights, options))
    want = prefill_logits(weights, options, tmp_path / "with")
    monkeypatch.setattr(graph, "CONTRIB_PASSES", ())
    without = op_types(built(weights, options))
    got = prefill_logits(weights, options, tmp_path / "without")

    layers = weights.spec.num_layers
    assert without.count("SkipSimplifiedLayerNormalization") == 0
    assert with_passes.count("SkipSimplifiedLayerNormalization") >= layers  # at least the norm before each MLP
    fused = with_passes.count("SkipSimplifiedLayerNormalization")
    assert with_passes.count("Add") == without.count("Add") - fused
    assert without.count("RotaryEmbedding") == 2 * layers and with_passes.count("RotaryEmbedding") == 0
    assert with_passes.count("Split") == without.count("Split") - layers
    assert np.abs(got - want).max() <= 1e-5


def test_partial_rotary_and_a_wider_compute_dtype_keep_their_rotations(checkpoint_dir):
    """The kernel rotates whole heads (Phi-3 here rotates half of each), and between a product held in f32
    and a bfloat16 run's rotation lie rounding casts: the rotations stay RotaryEmbeddings."""
    partial = built(open_model(str(checkpoint_dir("phi3-partial"))).weights, GraphOptions("ort", attention="gqa"))
    assert "RotaryEmbedding" in op_types(partial)
    assert all(a.name != "do_rotary" for n in partial.graph.node if n.op_type == "GroupQueryAttention"
               for a in n.attribute)
    weights = open_model(str(checkpoint_dir("llama-gqa3"))).weights
    wider = op_types(built(weights, GraphOptions("ort", "f32", "gqa"), dtype="bf16"))
    assert wider.count("RotaryEmbedding") == 2 * weights.spec.num_layers
    assert "SkipSimplifiedLayerNormalization" not in wider  # the sums are rounded to bfloat16 first


def rotated_attention(extra_reader: bool) -> list:
    """A fused q/k/v product split, q and k rotated, and GroupQueryAttention on them (as the ort variant
    emits before its passes), with or without another node reading the rotated q."""
    rotations = [helper.make_node("RotaryEmbedding", [part, "positions", "cos", "sin"], [f"rot_{part}"],
                                  domain="com.microsoft", num_heads=2) for part in ("q", "k")]
    nodes = [helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=-1), *rotations,
             helper.make_node("GroupQueryAttention", ["rot_q", "rot_k", "v", "pk", "pv", "lens", "total"],
                              ["attn", "pk.out", "pv.out"], name="attn", domain="com.microsoft", num_heads=2,
                              kv_num_heads=1, scale=0.25)]
    return nodes + ([helper.make_node("Identity", ["rot_q"], ["seen"])] if extra_reader else [])


def test_group_query_attention_takes_the_rotations_in_only_where_nothing_else_reads_them():
    facts = GraphFacts(frozenset(), exact=True)
    (attention,) = rotary_into_group_query_attention(rotated_attention(False), facts)
    assert list(attention.input) == ["qkv", "", "", "pk", "pv", "lens", "total", "cos", "sin"]
    attrs = {a.name: helper.get_attribute_value(a) for a in attention.attribute}
    assert attrs["do_rotary"] == 1 and attrs["rotary_interleaved"] == 0 and attrs["num_heads"] == 2
    assert abs(attrs["scale"] - 0.25) < 1e-7
    kept = rotated_attention(True)
    assert rotary_into_group_query_attention(kept, facts) == kept
    assert rotary_into_group_query_attention(rotated_attention(False), replace(facts, exact=False)) == \
        rotated_attention(False)


def test_a_norm_takes_in_only_an_add_of_the_residual_stream_right_before_it():
    add = helper.make_node("Add", ["x", "h"], ["sum"])
    norm = helper.make_node("SimplifiedLayerNormalization", ["sum", "w"], ["norm"], name="norm", axis=-1,
                            epsilon=1e-6)
    (fused,) = skip_norms([add, norm], GraphFacts(frozenset({"sum"}), exact=True))
    assert fused.op_type == "SkipSimplifiedLayerNormalization"
    assert list(fused.input) == ["x", "h", "w"] and list(fused.output) == ["norm", "", "", "sum"]
    assert skip_norms([add, norm], GraphFacts(frozenset(), exact=True)) == [add, norm]  # not a residual sum
    between = helper.make_node("Identity", ["x"], ["y"])
    assert skip_norms([add, between, norm], GraphFacts(frozenset({"sum"}), exact=True)) == [add, between, norm]


def test_an_unknown_variant_or_attention_form_is_refused_by_name(checkpoint_dir):
    weights = open_model(str(checkpoint_dir("llama-gqa3"))).weights
    with pytest.raises(ValueError, match="unknown ONNX graph variant 'tensorrt'"):
        built(weights, GraphOptions("tensorrt"))
    with pytest.raises(ValueError, match="unknown ONNX attention form 'flash'"):
        built(weights, GraphOptions("ort", attention="flash"))
    with pytest.raises(ValueError, match="needs the ort variant"):
        built(weights, GraphOptions("plain", attention="gqa"))

