"""Rewrites over an emitted graph's nodes that join several ops' nodes into one ONNX Runtime kernel (the ort
variant). Each is a function of the node list and the emitter's facts, returning the new list; the graph
runs them in order (``CONTRIB_PASSES``). A rewrite that does not apply leaves the nodes as they are.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx
from onnx import helper


@dataclass(frozen=True)
class GraphFacts:
    """What the emitter knows that the nodes do not say."""
    residual_sums: frozenset[str]  # the residual stream's sums, held in the run dtype (``Emitter.residual_sums``)
    exact: bool  # ops compute in the run dtype: no rounding casts between a product and what reads it


Pass = Callable[[list[onnx.NodeProto], GraphFacts], list[onnx.NodeProto]]


def skip_norms(nodes: list[onnx.NodeProto], facts: GraphFacts) -> list[onnx.NodeProto]:
    """SkipSimplifiedLayerNormalization for an RMS norm (SimplifiedLayerNormalization) right after the Add of
    the residual stream that it reads: the add and the norm in one pass, the sum still made (the fused node's
    fourth output, under the Add's name). Applies where that sum is held in the run dtype (``GraphFacts``)."""
    out: list[onnx.NodeProto] = []
    for node in nodes:
        last = out[-1] if out else None
        if (node.op_type == "SimplifiedLayerNormalization" and last is not None and last.op_type == "Add"
                and last.output[0] == node.input[0] and node.input[0] in facts.residual_sums):
            out.pop()
            out.append(helper.make_node("SkipSimplifiedLayerNormalization", [*last.input, node.input[1]],
                                        [node.output[0], "", "", last.output[0]], name=node.name,
                                        domain="com.microsoft", epsilon=_attribute(node, "epsilon")))
        else:
            out.append(node)
    return out


def rotary_into_group_query_attention(nodes: list[onnx.NodeProto], facts: GraphFacts) -> list[onnx.NodeProto]:
    """GroupQueryAttention rotating q and k itself (do_rotary), on the fused q/k/v product: where its q and k
    are RotaryEmbeddings at the step's ``positions`` by one pair of tables, of the first two parts of a Split
    whose third part is its v, and nothing else reads those rotations or parts (no q/k norm between), the
    Split and both rotations go, and the kernel takes the product and the tables. Not where ops compute in a
    wider dtype than the run dtype (rounding casts lie between), nor with partial rotary (q and k are then
    concatenations: the kernel rotates whole heads)."""
    if not facts.exact:
        return nodes
    made = {out: node for node in nodes for out in node.output if out}
    taken: set[int] = set()  # ids of the nodes taken in
    rewritten: dict[int, onnx.NodeProto] = {}
    for node in nodes:
        if node.op_type != "GroupQueryAttention":
            continue
        q, k, v = node.input[:3]
        rot_q, rot_k, split = made.get(q), made.get(k), made.get(v)
        if not (rot_q and rot_k and split and split.op_type == "Split"
                and all(r.op_type == "RotaryEmbedding" and r.input[1] == "positions" for r in (rot_q, rot_k))
                and rot_q.input[2:] == rot_k.input[2:]
                and [rot_q.input[0], rot_k.input[0], v] == list(split.output)):
            continue
        parts = {*rot_q.output, *rot_k.output, *split.output[:2]}
        group = {id(rot_q), id(rot_k), id(split), id(node)}
        if any(parts & reads(other) for other in nodes if id(other) not in group):
            continue
        taken.update({id(rot_q), id(rot_k), id(split)})
        inputs = list(node.input)  # q, k, v, past k and v, lengths; then tables, position ids, bias, sinks
        tables = [rot_q.input[2], rot_q.input[3]]
        rest = inputs[9:] if len(inputs) > 7 else []
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        rewritten[id(node)] = helper.make_node(
            node.op_type, [split.input[0], "", "", *inputs[3:7], *tables, *rest], list(node.output), name=node.name,
            domain=node.domain, **attrs, do_rotary=1, rotary_interleaved=0)
    return [rewritten.get(id(node), node) for node in nodes if id(node) not in taken]


def gathered_attention(nodes: list[onnx.NodeProto], facts: GraphFacts) -> list[onnx.NodeProto]:
    """GroupQueryAttention's rows apart from the step's tokens (``GraphOptions.ragged``): its q, k and v are
    gathered from the step's [R, T] tokens into its own [B, W] (``unpack``: for each of its rows' W slots, the
    token's place (r, t)) and its result back (``pack``: for each token, its place (b, w)), and its lengths read
    ``gqa_positions`` [B, W]. A step whose rows' chunks differ in length then runs its products on their own
    tokens (R = 1, T their sum) and pads only the kernel's rows, whose padding writes cache positions past each
    row's chunk, read by no query before they are written again. Other steps pass the identity (B, W = R, T).
    Runs after the rotary rewrite, which reads the rotations feeding the kernel."""
    out: list[onnx.NodeProto] = []
    for node in nodes:
        if node.op_type != "GroupQueryAttention":
            out.append(node)
            continue
        inputs = list(node.input)
        for i in range(3):  # q (or the fused q/k/v product), k, v
            if inputs[i]:
                out.append(helper.make_node("GatherND", [inputs[i], "unpack"], [f"{inputs[i]}.rows"],
                                            name=f"{node.name}.unpack{i}"))
                inputs[i] = f"{inputs[i]}.rows"
        result = node.output[0]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        out.append(helper.make_node(node.op_type, inputs, [f"{result}.rows", *node.output[1:]], name=node.name,
                                    domain=node.domain, **attrs))
        out.append(helper.make_node("GatherND", [f"{result}.rows", "pack"], [result], name=f"{node.name}.pack"))
    return out


# The ort variant's rewrites, in the order they run.
CONTRIB_PASSES: tuple[Pass, ...] = (skip_norms, rotary_into_group_query_attention)


def reads(node: onnx.NodeProto) -> set[str]:
    """The names a node reads: its inputs, and those its subgraphs' nodes read (a Loop's body)."""
    names = set(node.input)
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            names.update(name for inner in attribute.g.node for name in reads(inner))
    return names


def _attribute(node: onnx.NodeProto, name: str) -> object:
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)
