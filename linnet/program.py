"""The Linnet program: a model as block-level ops that every runtime already has a fast kernel for.

A program has three parts: ``embed`` (tokens -> x), ``layer`` (x -> x, one block applied
``num_layers`` times with that layer's weights and KV cache) and ``head`` (x -> logits). Each op
names its output, its inputs (values or ``w.<part>`` weights) and constant attributes. Backends
turn each op kind into a line of their own code; Llama, Qwen2 and Qwen3 differ only in which ops
appear, decided here from the spec.

Op kinds:
  embedding(tokens, w)          rows of the embedding table
  rms_norm(x, w; eps)           RMS norm over the last axis (also per head, for q/k norm)
  linear(x, w[, b])             x @ w.T (+ b)
  split_heads(x; heads)         [..., heads*head_dim] -> [..., heads, head_dim]
  rotary(x)                     rotary position embedding at the call's positions
  attention(q, k, v)            writes k, v into this layer's cache, attends causally over it
  swiglu(gate, up)              silu(gate) * up
  add(a, b)                     residual add
  split(x; sizes)               one value into several along the last axis (``out`` names them, "a, b")
  norm_linear(x, n, w[, b]; eps)  rms_norm(x, n) read only by linear(., w[, b]): one op (fuse_norm_linears)
  rms_linear(x, w[, b]; eps[, norm])  norm_linear with n folded into w's columns, w[:, i] * n[i]
                                (fold_norm_weights); attrs["norm"] names an n left unfolded (a tied head)

The head reads ``w.lm_head``; for a tied model each backend binds it to the embedding table.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from linnet.spec import ModelSpec


@dataclass(frozen=True)
class Op:
    kind: str
    out: str
    inputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Program:
    spec: ModelSpec
    embed: tuple[Op, ...]
    layer: tuple[Op, ...]
    head: tuple[Op, ...]
    # Weights a backend must build by concatenating others along the output axis: (name, parts).
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Weights whose columns a backend must multiply by a norm's weight: (section, weight, norm), the
    # section being "layer" (names within each layer) or "head".
    folded: tuple[tuple[str, str, str], ...] = ()


def build_program(spec: ModelSpec) -> Program:
    eps = {"eps": spec.rms_norm_eps}

    def bias(part: str, present: bool) -> tuple[str, ...]:
        return (f"w.{part}",) if present else ()

    layer = [
        Op("rms_norm", "h", ("x", "w.attn_norm"), eps),
        Op("linear", "q", ("h", "w.q", *bias("q_bias", spec.qkv_bias))),
        Op("linear", "k", ("h", "w.k", *bias("k_bias", spec.qkv_bias))),
        Op("linear", "v", ("h", "w.v", *bias("v_bias", spec.qkv_bias))),
        Op("split_heads", "q", ("q",), {"heads": spec.num_heads}),
        Op("split_heads", "k", ("k",), {"heads": spec.num_kv_heads}),
        Op("split_heads", "v", ("v",), {"heads": spec.num_kv_heads}),
    ]
    if spec.qk_norm:
        layer += [
            Op("rms_norm", "q", ("q", "w.q_norm"), eps),
            Op("rms_norm", "k", ("k", "w.k_norm"), eps),
        ]
    layer += [
        Op("rotary", "q", ("q",)),
        Op("rotary", "k", ("k",)),
        Op("attention", "a", ("q", "k", "v")),
        Op("linear", "a", ("a", "w.o", *bias("o_bias", spec.o_bias))),
        Op("add", "x", ("x", "a")),
        Op("rms_norm", "h", ("x", "w.mlp_norm"), eps),
        Op("linear", "g", ("h", "w.gate")),
        Op("linear", "u", ("h", "w.up")),
        Op("swiglu", "h", ("g", "u")),
        Op("linear", "h", ("h", "w.down")),
        Op("add", "x", ("x", "h")),
    ]
    return Program(
        spec=spec,
        embed=(Op("embedding", "x", ("tokens", "w.embed")),),
        layer=tuple(layer),
        head=(Op("rms_norm", "x", ("x", "w.norm"), eps), Op("linear", "logits", ("x", "w.lm_head"))),
    )


# Projections that read the same input, fused into one wider matrix: one pass over the input, fewer and
# larger matrix products (on CPUs the matrix-vector products of decode are bandwidth-bound, and larger
# ones get closer to the bandwidth).
_FUSIONS = {("q", "k", "v"): "qkv", ("gate", "up"): "gate_up"}


def fuse_projections(program: Program) -> Program:
    """Replace q/k/v and gate/up linears by one linear each, followed by a split."""
    spec = program.spec
    sizes = {"q": spec.q_size, "k": spec.kv_size, "v": spec.kv_size,
             "gate": spec.intermediate_size, "up": spec.intermediate_size}
    ops, fused, i = list(program.layer), [], 0
    while i < len(ops):
        for parts, name in _FUSIONS.items():
            run = ops[i:i + len(parts)]
            if [op.kind for op in run] == ["linear"] * len(parts) and \
                    [op.inputs[1] for op in run] == [f"w.{p}" for p in parts] and \
                    len({op.inputs[0] for op in run}) == 1:
                biased = [len(op.inputs) == 3 for op in run]
                if any(biased) and not all(biased):
                    break  # a partly biased run would need zero biases invented: leave it unfused
                inputs = (run[0].inputs[0], f"w.{name}")
                fused.append((name, parts))
                if all(biased):
                    inputs += (f"w.{name}_bias",)
                    fused.append((f"{name}_bias", tuple(f"{p}_bias" for p in parts)))
                ops[i:i + len(parts)] = [
                    Op("linear", name, inputs),
                    Op("split", ", ".join(op.out for op in run), (name,), {"sizes": tuple(sizes[p] for p in parts)}),
                ]
                break
        i += 1
    return replace(program, layer=tuple(ops), fused=tuple(fused))


def fuse_norm_linears(program: Program) -> Program:
    """Each RMS norm whose output only the next op reads, a linear, becomes one `norm_linear`.

    Run after fuse_projections, which leaves one linear after each norm. A backend can then apply the
    norm's per-token scale after the product instead of to every input of it.
    """
    def fuse(ops: tuple[Op, ...]) -> tuple[Op, ...]:
        out, i = [], 0
        while i < len(ops):
            norm, nxt = ops[i], ops[i + 1] if i + 1 < len(ops) else None
            if norm.kind == "rms_norm" and nxt is not None and nxt.kind == "linear" \
                    and nxt.inputs[0] == norm.out and not _read_later(ops[i + 2:], norm.out):
                out.append(Op("norm_linear", nxt.out, (*norm.inputs, *nxt.inputs[1:]), norm.attrs))
                i += 2
            else:
                out.append(norm)
                i += 1
        return tuple(out)

    return replace(program, layer=fuse(program.layer), head=fuse(program.head))


def fold_norm_weights(program: Program) -> Program:
    """Each norm_linear becomes an rms_linear over its weight with the norm's weight folded in.

    rms_norm(x, n) @ w.T == (x * scale) @ (w * n).T, with scale = rsqrt(mean(x^2) + eps) per token; the
    backend multiplies the weight's columns once when it prepares the weights, so a one-token step
    reads plain weights against plain x, and nothing is multiplied per weight it streams. A tied head
    keeps its norm weight apart (attrs["norm"]): its matrix is the embedding too, and a folded copy
    would add the embedding's size to the memory a process maps.
    """
    folded = []
    tied = program.spec.tie_word_embeddings

    def fold(section: str, ops: tuple[Op, ...]) -> tuple[Op, ...]:
        out = []
        for op in ops:
            if op.kind == "norm_linear":
                x, n, w, *b = op.inputs
                attrs = op.attrs
                if tied and w == "w.lm_head":
                    attrs = {**attrs, "norm": n}
                else:
                    folded.append((section, w.removeprefix("w."), n.removeprefix("w.")))
                op = Op("rms_linear", op.out, (x, w, *b), attrs)
            out.append(op)
        return tuple(out)

    layer, head = fold("layer", program.layer), fold("head", program.head)
    return replace(program, layer=layer, head=head, folded=program.folded + tuple(folded))


def _read_later(ops: tuple[Op, ...], name: str) -> bool:
    """Whether a later op reads `name` before something assigns it again."""
    for op in ops:
        if name in op.inputs:
            return True
        if name in op.out.split(", "):
            return False
    return False
