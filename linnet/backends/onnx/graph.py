"""The Program's step as an ONNX graph, built node by node with ``onnx.helper`` (no tracing).

The graph is the whole batched step (``linnet.program``):

    step(tokens [R, T], positions [R, T], rows [R], select [R, S], cache_k.<i>, cache_v.<i>)
        -> logits [R, S, VOCAB] f32, next_ids [R, S] i64 (the argmax), cache_k.<i>.out, cache_v.<i>.out

and, for the runner's own ragged graphs (``GraphOptions.ragged``), GroupQueryAttention's rows
``gqa_positions [B, W]``, ``unpack [B, W, 2]`` and ``pack [R, T, 2]`` (``passes.gathered_attention``);
with one ``[ROWS, KV_HEADS, P, HEAD_DIM]`` cache per layer (a sliding layer's ring: ``SLOTS`` for ``P``),
``P`` free, and the rotary tables and the weights as initializers. Two variants:

- ``plain``: standard ONNX operators only (opset 18), for any ONNX consumer (``lower``);
- ``ort``: ONNX Runtime's contrib operators where they replace several plain ones (``contrib``), then
  the rewrites that join nodes into one kernel (``passes.CONTRIB_PASSES``).

Each layer is emitted inline with its kind's section (``Program.layer_section``). Composites without a
form here (``NATIVE_OPS``) arrive as their decompositions (``linnet.program.lower``).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import onnx
from onnx import TensorProto, helper

from linnet.backends.onnx.blocks import PARTS, block_size
from linnet.backends.onnx.contrib import INTERLEAVED, BlockWeight, OrtEmitter, with_interleaved
from linnet.backends.onnx.lower import ONNX_TYPES, OPSET, Emitter, GraphOptions
from linnet.backends.onnx.passes import CONTRIB_PASSES, GraphFacts, gathered_attention, reads
from linnet.program import Program, infer_types, layer_section_name, lower
from linnet.quantize import block_names

__all__ = ["INTERLEAVED", "NATIVE_OPS", "GraphOptions", "build_graph"]

# The ops emitted here: every primitive and kernel, and the composites with a form of their own (SwiGLU as
# one Mul of a Sigmoid, LayerNorm as LayerNormalization, softcap dividing by its cap); norm_linear arrives
# decomposed.
NATIVE_OPS = frozenset({
    "embedding", "linear", "split", "concat", "split_heads", "cache_write", "select", "cast", "add", "sub", "mul",
    "scale", "shift", "tanh", "rsqrt", "mean", "activation",
    "rms_norm", "rotary", "attention", "rms_linear",
    "swiglu", "layer_norm", "softcap", "moe"})
EMITTERS: dict[str, type[Emitter]] = {"plain": Emitter, "ort": OrtEmitter}
PLAIN = GraphOptions()


def emitter(program: Program, options: GraphOptions) -> Emitter:
    """The variant's emitter; GroupQueryAttention is an ONNX Runtime contrib operator (ort only)."""
    if options.variant not in EMITTERS:
        raise ValueError(f"unknown ONNX graph variant {options.variant!r}; choose from {', '.join(EMITTERS)}")
    if options.attention not in ("gather", "gqa"):
        raise ValueError(f"unknown ONNX attention form {options.attention!r}; choose from gather, gqa")
    if options.attention == "gqa" and options.variant != "ort":
        raise ValueError("GroupQueryAttention is an ONNX Runtime contrib operator: it needs the ort variant")
    return EMITTERS[options.variant](program, options)


def build_graph(program: Program, weight_shapes: Mapping[str, tuple[int, ...]], rope_positions: int,
                options: GraphOptions = PLAIN) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The step as a ModelProto whose weights are declared but not filled (``attach_weights`` does).

    ``weight_shapes`` are the weight plan's arrays' shapes by name; rope tables cover ``rope_positions``.
    Returns the model and, per initializer name of a weight, the weight plan's name.
    """
    program = lower(program, NATIVE_OPS)
    typed = infer_types(program)  # each section's values
    spec = program.spec
    e = emitter(program, options)
    weights: dict[str, str] = {}  # initializer name -> plan name
    stored = program.dtype  # weights are stored in the run dtype, cast once where compute is wider

    blocks = with_interleaved(block_names(program.quantized, spec.num_layers))
    if blocks and not e.contrib:
        raise ValueError("matrices in blocks run on ONNX Runtime's contrib operators: they need the ort variant")
    part_types = {"codes": TensorProto.UINT8, "zero_points": TensorProto.UINT8,
                  "scales": ONNX_TYPES[e.compute], "mins": ONNX_TYPES[e.compute]}
    types: dict[str, int] = {}  # an initializer's type where it is not the weights' dtype

    def weight(plan_name: str) -> str:
        def declare() -> str:
            name = "w." + plan_name
            e.names.add(name)
            if plan_name in blocks:  # its parts are the initializers; ``name`` only keys ``e.blocks``
                parts = {p: f"{name}.{p}" for p in PARTS if f"{plan_name}.{p}" in weight_shapes}
                for part, initializer in parts.items():
                    weights[initializer], types[initializer] = f"{plan_name}.{part}", part_types[part]
                    e.names.add(initializer)
                n, nb = weight_shapes[f"{plan_name}.scales"][-2:]  # a stack's: [experts, n, nb]
                k = nb * block_size(blocks[plan_name])
                assert isinstance(e, OrtEmitter)  # the plain variant refuses blocks (above)
                e.blocks[name] = BlockWeight(blocks[plan_name], n, k, parts)
                return name
            weights[name] = plan_name
            if e.compute == stored:
                e.weight_shapes[name] = weight_shapes[plan_name]
                return name
            wide = e.cast(name, e.compute, f"{name}.{e.compute}")  # folded into a constant at session load
            e.weight_shapes[wide] = weight_shapes[plan_name]
            return wide
        return e._once(f"weight:{plan_name}", declare)

    def layer_weights(i: int) -> Callable[[str], str]:
        return lambda name: weight(f"layers.{i}.{name}")

    named: list[tuple[str, list[str | int]]] = [("tokens", ["R", "T"]), ("positions", ["R", "T"]), ("rows", ["R"]),
                                              ("select", ["R", "S"])]
    if options.ragged:  # GroupQueryAttention's own rows (``passes.gathered_attention``)
        if options.attention != "gqa":
            raise ValueError("ragged steps gather GroupQueryAttention's rows: they need attention='gqa'")
        named += [("gqa_positions", ["B", "W"]), ("unpack", ["B", "W", 2]), ("pack", ["R", "T", 2])]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, shape) for n, shape in named]
    cache_type = ONNX_TYPES[e.compute]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["R", "S", spec.vocab_size]),
               helper.make_tensor_value_info("next_ids", TensorProto.INT64, ["R", "S"])]
    e.names.update((*(n for n, _ in named), "logits", "next_ids"))
    rope = e.rope_initializers(rope_positions)

    env = {n: n for n in ("tokens", "positions", "rows", "select", "rope_cos", "rope_sin")}
    e.emit_section(program.embed, typed["embed"], env, weight)
    x = env[program.embed.results[0]]
    rings = [program.ring(kind) for kind in program.layer_kinds]
    e.full_cache = f"cache_k.{next((i for i, ring in enumerate(rings) if ring is None), 0)}"
    for i in range(spec.num_layers):
        names = {kind: f"cache_{kind}.{i}" for kind in "kv"}
        section_types = typed[layer_section_name(program, program.layer_kinds[i])]
        _, kv_heads, _, head_dim = section_types["cache_k"].shape  # a ring's slots: any number, as positions
        shape = ["ROWS", kv_heads, "P" if rings[i] is None else "SLOTS", head_dim]
        for kind in "kv":
            e.names.add(names[kind])
            inputs.append(helper.make_tensor_value_info(names[kind], cache_type, shape))
            outputs.append(helper.make_tensor_value_info(f"{names[kind]}.out", cache_type, shape))
        layer_env = {**env, "x": x, "cache_k": names["k"], "cache_v": names["v"]}
        section = program.layer_section(i)
        e.emit_section(section, section_types, layer_env, layer_weights(i))
        x = layer_env[section.results[0]]
    head_weights = (lambda n: weight("embed" if n == "lm_head" else n)) if spec.tie_word_embeddings else weight
    head_env = {**env, "x": x}
    e.lead_source = "select"
    e.emit_section(program.head, typed["head"], head_env, head_weights)
    last = e.nodes[-1]  # the head's last node makes the logits: it names them as the graph's output (no copy)
    assert last.output[0] == head_env[program.head.results[0]]
    last.output[0] = "logits"
    e.nodes.append(helper.make_node("ArgMax", ["logits"], ["next_ids"], axis=-1, keepdims=0))

    facts = GraphFacts(frozenset(e.residual_sums), exact=e.compute == e.act)
    for rewrite in (*CONTRIB_PASSES, *([gathered_attention] if options.ragged else [])) if e.contrib else ():
        e.nodes = rewrite(e.nodes, facts)
    nodes = _live(e.nodes, {o.name for o in outputs})
    read = {name for node in nodes for name in reads(node)}
    weights = {name: plan for name, plan in weights.items() if name in read}
    declared = [_declared(name, types.get(name, ONNX_TYPES[stored]), weight_shapes[plan])
                for name, plan in weights.items()]
    graph = helper.make_graph(nodes, f"linnet_{spec.architecture}_step", inputs, outputs,
                              initializer=[*rope, *e.constants, *declared])
    opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid("com.microsoft", 1)] if e.contrib else [])
    model = helper.make_model(graph, opset_imports=opsets, producer_name="linnet")
    model.ir_version = 9  # opset 18's; readable by ONNX Runtime 1.15+ and onnx 1.14+
    return model, weights


def _live(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """The nodes the graph's outputs need, in order. The others go, and the weights only they read: the
    ort variant's MoE reads the experts' gate and up interleaved (``INTERLEAVED``), not the Program's stacks."""
    needed, kept = set(outputs), []
    for node in reversed(nodes):
        if needed.intersection(node.output):
            kept.append(node)
            needed.update(reads(node))
    return kept[::-1]


def _declared(name: str, data_type: int, shape: tuple[int, ...]) -> onnx.TensorProto:
    """A weight's initializer, its data to be attached as external data."""
    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=shape)
    tensor.data_location = TensorProto.EXTERNAL
    return tensor
