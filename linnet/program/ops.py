"""The op table: each op's tier, type rule and, for a composite, its decomposition into other ops.

Three tiers:
- ``primitive``: small ops every emitter lowers (arithmetic, products, gathers, reshapes, cache writes).
- ``kernel``: composites every emitter lowers natively, since each runtime has its own fast form and a
  decomposition would say nothing an emitter could use (attention over the cache, RMS norm, rotary).
- ``composite``: ops with a decomposition into others; an emitter lowers them natively where its runtime
  has a fast kernel, and otherwise ``linnet.program.passes.lower`` replaces them by their decomposition.

What each op computes is defined in ``linnet.program``'s docstring; the rules here are what its inputs
and outputs must be.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from linnet.errors import LinnetError
from linnet.program.ir import Op, Program, Value
from linnet.spec import EXPERT_ACTIVATIONS, GATINGS, ModelSpec

Fresh = Callable[[str], str]  # a new value name from a hint


@dataclass(frozen=True)
class OpDef:
    tier: str  # "primitive" | "kernel" | "composite"
    infer: Callable[[Op, list[Value], ModelSpec, str], list[Value]]
    decompose: Callable[[Op, Fresh], list[Op]] | None = None
    arity: int = 0  # a composite's number of inputs


def _need(op: Op, args: list[Value], cond: bool, what: str) -> None:
    if not cond:
        raise LinnetError(f"op {op}: {what} (inputs: {', '.join(map(str, args))})")


def _broadcasts(small: Value, big: Value) -> bool:
    """``small`` broadcasts to ``big``: its shape is a suffix of big's, with 1s allowed."""
    if len(small.shape) > len(big.shape):
        return False
    tail = big.shape[len(big.shape) - len(small.shape):]
    return all(s == 1 or s == b for s, b in zip(small.shape, tail))


def _same(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    return [args[0]]


def _binary(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    a, b = args
    _need(op, args, _broadcasts(b, a), "the second input must broadcast to the first")
    return [a]


def _embedding(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    return [Value((*args[0].shape, args[1].shape[1]), act)]


def _norm(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    a = args[0]
    _need(op, args, all(w.shape == (a.shape[-1],) for w in args[1:]), "a norm's weights must match the last axis")
    return [a]


def _linear(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    a = args[0]
    if op.kind == "norm_linear":
        _need(op, args, args[1].shape == (a.shape[-1],), "the norm weight must match x's last axis")
        args = [a, *args[2:]]
    w, extra = args[1], args[2:]
    _need(op, args, len(w.shape) == 2 and w.shape[1] == a.shape[-1], "the weight's in-size must match x's last axis")
    if op.attrs.get("norm"):  # rms_linear with its norm weight apart, the last input
        _need(op, args, extra[-1].shape == (a.shape[-1],), "the norm weight must match x's last axis")
        extra = extra[:-1]
    _need(op, args, all(b.shape == (w.shape[0],) for b in extra) and len(extra) <= 1, "a bias must match the out-size")
    return [Value((*a.shape[:-1], w.shape[0]), a.dtype)]


def _split(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    a, sizes = args[0], op.attrs["sizes"]
    _need(op, args, sum(sizes) == a.shape[-1] and len(sizes) == len(op.outs), "sizes must cover the last axis")
    return [Value((*a.shape[:-1], n), a.dtype) for n in sizes]


def _concat(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    a = args[0]
    _need(op, args, all(v.shape[:-1] == a.shape[:-1] and v.dtype == a.dtype for v in args),
          "inputs must differ in their last axis only")
    last = [v.shape[-1] for v in args]
    _need(op, args, all(isinstance(n, int) for n in last), "the last axes must be fixed sizes")
    return [Value((*a.shape[:-1], sum(int(n) for n in last)), a.dtype)]


def _split_heads(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    a, heads = args[0], op.attrs["heads"]
    _need(op, args, a.shape[-1] == heads * spec.head_dim, "the last axis must be heads x head_dim")
    return [Value((*a.shape[:-1], heads, spec.head_dim), a.dtype)]


def _rotary(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    a, positions, cos, sin = args
    _need(op, args, len(a.shape) == 4 and positions.shape == a.shape[:2], "x [R, T, heads, D]")
    _need(op, args, set(op.attrs) <= {"table"}, f"rotary takes a table attr only, not {sorted(op.attrs)}")
    table = op.attrs.get("table", 0)
    width, total = a.shape[-1], cos.shape[-1]
    _need(op, args, isinstance(width, int) and isinstance(total, int) and cos.shape == sin.shape,
          "x's width and the tables' must be fixed, cos and sin of one shape")
    assert isinstance(width, int) and isinstance(total, int)
    _need(op, args, total % width == 0, "the tables' width must be a multiple of x's (each table is x's width)")
    _need(op, args, type(table) is int and 0 <= table < total // width,
          f"table must be an index of one of the {total // width} tables, not {table!r}")
    return [a]


def _cache_write(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    a = args[0]
    _need(op, args, args[3].shape[2:] == a.shape[1:2] + a.shape[3:], "values must match the cache's heads and head_dim")
    _need(op, args, set(op.attrs) in (set(), {"ring", "scratch"}), "cache_write takes ring and scratch, or no attrs")
    _need(op, args, type(op.attrs.get("scratch", 0)) is int and op.attrs.get("scratch", 0) >= 0,
          "the scratch position must be a position")
    _ring(op, args)
    return [a]


def _ring(op: Op, args: list[Value]) -> None:
    """A ring's slots (attr ``ring``) and its cache: ring + 1 positions (the last the scratch slot)."""
    if "ring" in op.attrs:
        ring = op.attrs["ring"]
        _need(op, args, type(ring) is int and ring > 0 and args[0].shape[2] == ring + 1,
              "a ring is a positive number of slots, its cache one position more")


def _attention(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    a = args[0]
    _need(op, args, int(a.shape[2]) % int(args[1].shape[1]) == 0, "query heads must be a multiple of key/value heads")
    _need(op, args, isinstance(op.attrs.get("scale"), float), "attention needs its scale")
    window = op.attrs.get("window")
    _need(op, args, window is None or type(window) is int and window > 0, "a window must be a positive integer")
    sinks = op.attrs.get("sinks", False)
    _need(op, args, type(sinks) is bool and len(args) == 5 + sinks and (not sinks or args[5].shape == a.shape[2:3]),
          "attention's sinks (attr sinks=True) are a sixth input, one logit per query head")
    _need(op, args, "ring" not in op.attrs or window is not None, "a ring cache is a windowed attention's")
    _ring(op, args[1:])
    return [Value((*a.shape[:2], int(a.shape[2]) * int(a.shape[3])), a.dtype)]


def _pair(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    a, b = args
    _need(op, args, a.shape == b.shape and a.dtype == b.dtype, "both inputs must have one shape and dtype")
    return [a]


def _select(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    a = args[0]
    return [Value((a.shape[0], args[1].shape[1], *a.shape[2:]), a.dtype)]


def _cast(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    return [Value(args[0].shape, op.attrs["dtype"])]


def _mean(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    return [Value((*args[0].shape[:-1], 1), args[0].dtype)]


def _activation(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    _need(op, args, op.attrs.get("fn") in ACTIVATIONS, f"fn must be one of {ACTIVATIONS}")
    return [args[0]]


ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
MOE_ATTRS = {"top_k", "gating", "normalize", "activation", "alpha", "limit", "router_bias", "expert_bias"}


def _moe(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    attrs = op.attrs
    _need(op, args, set(attrs) <= MOE_ATTRS, f"moe takes the attrs {sorted(MOE_ATTRS)}, not {sorted(attrs)}")
    _need(op, args, len(args) >= 5 and all(len(v.shape) == n for v, n in zip(args[1:5], (2, 3, 3, 3))),
          "moe reads x, then the router and the experts' gate, up and down")
    _need(op, args, all(attrs[f] is True for f in ("normalize", "router_bias", "expert_bias") if f in attrs),
          "normalize, router_bias and expert_bias are True where present")
    x, router, gate, up, down, *rest = args
    experts, width = router.shape
    size = gate.shape[1]
    _need(op, args, width == x.shape[-1] and gate.shape == up.shape == (experts, size, width)
          and down.shape == (experts, width, size), "router [E, D], gate and up [E, F, D], down [E, D, F]")
    bias_shapes = [(experts,)] * bool(attrs.get("router_bias")) + \
        [(experts, size), (experts, size), (experts, width)] * bool(attrs.get("expert_bias"))
    _need(op, args, [b.shape for b in rest] == bias_shapes,
          "biases after down, as the attrs say: router_bias [E]; expert_bias: gate and up [E, F], down [E, D]")
    top_k = attrs.get("top_k")
    _need(op, args, type(top_k) is int and 0 < top_k <= int(experts), "top_k must be 1 to the number of experts")
    _need(op, args, attrs.get("gating") in GATINGS, f"gating must be one of {GATINGS}")
    _need(op, args, "normalize" not in attrs or attrs["gating"] == "softmax_topk", "normalize is softmax_topk's")
    clamped = attrs.get("activation") == "clamped_swiglu"
    _need(op, args, attrs.get("activation") in EXPERT_ACTIVATIONS, f"activation must be one of {EXPERT_ACTIVATIONS}")
    _need(op, args, all(isinstance(attrs.get(k), float) == clamped == (k in attrs) for k in ("alpha", "limit")),
          "clamped_swiglu takes alpha and limit (floats), swiglu neither")
    return [x]


# -- decompositions -------------------------------------------------------------------------------------

def _swiglu(op: Op, fresh: Fresh) -> list[Op]:
    gate, up = op.inputs
    silu = fresh(f"{op.outs[0]}_silu")
    return [Op("activation", (silu,), (gate,), {"fn": "silu"}), Op("mul", op.outs, (silu, up))]


def _softcap(op: Op, fresh: Fresh) -> list[Op]:
    cap = op.attrs["cap"]
    scaled, bent = fresh(f"{op.outs[0]}_scaled"), fresh(f"{op.outs[0]}_tanh")
    return [Op("scale", (scaled,), op.inputs, {"factor": 1.0 / cap}), Op("tanh", (bent,), (scaled,)),
            Op("scale", op.outs, (bent,), {"factor": cap})]


def _layer_norm(op: Op, fresh: Fresh) -> list[Op]:
    """In float32: (x - mean) * rsqrt(var + eps) * w + b, rounded once to the run dtype at the end."""
    x, w, b = op.inputs
    out = op.outs[0]
    n = {k: fresh(f"{out}_{k}") for k in ("x32", "mean", "centred", "square", "var", "shifted", "scale",
                                            "normed", "w32", "scaled", "b32", "y")}
    return [
        Op("cast", (n["x32"],), (x,), {"dtype": "f32"}),
        Op("mean", (n["mean"],), (n["x32"],)),
        Op("sub", (n["centred"],), (n["x32"], n["mean"])),
        Op("mul", (n["square"],), (n["centred"], n["centred"])),
        Op("mean", (n["var"],), (n["square"],)),
        Op("shift", (n["shifted"],), (n["var"],), {"amount": op.attrs["eps"]}),
        Op("rsqrt", (n["scale"],), (n["shifted"],)),
        Op("mul", (n["normed"],), (n["centred"], n["scale"])),
        Op("cast", (n["w32"],), (w,), {"dtype": "f32"}),
        Op("mul", (n["scaled"],), (n["normed"], n["w32"])),
        Op("cast", (n["b32"],), (b,), {"dtype": "f32"}),
        Op("add", (n["y"],), (n["scaled"], n["b32"])),
        Op("cast", op.outs, (n["y"],), {"dtype": op.attrs["dtype"]}),
    ]


def _norm_linear(op: Op, fresh: Fresh) -> list[Op]:
    x, n, w, *b = op.inputs
    normed = fresh(f"{op.outs[0]}_normed")
    return [Op("rms_norm", (normed,), (x, n), {"eps": op.attrs["eps"]}), Op("linear", op.outs, (normed, w, *b))]


OPS: dict[str, OpDef] = {
    # primitives
    "embedding": OpDef("primitive", _embedding),
    "linear": OpDef("primitive", _linear),
    "split": OpDef("primitive", _split),
    "concat": OpDef("primitive", _concat),
    "split_heads": OpDef("primitive", _split_heads),
    "cache_write": OpDef("primitive", _cache_write),
    "select": OpDef("primitive", _select),
    "cast": OpDef("primitive", _cast),
    "add": OpDef("primitive", _binary),
    "sub": OpDef("primitive", _binary),
    "mul": OpDef("primitive", _binary),
    "scale": OpDef("primitive", _same),
    "shift": OpDef("primitive", _same),
    "tanh": OpDef("primitive", _same),
    "rsqrt": OpDef("primitive", _same),
    "mean": OpDef("primitive", _mean),
    "activation": OpDef("primitive", _activation),
    # kernels: lowered natively by every emitter
    "rms_norm": OpDef("kernel", _norm),
    "rotary": OpDef("kernel", _rotary),
    "attention": OpDef("kernel", _attention),
    "rms_linear": OpDef("kernel", _linear),
    "moe": OpDef("kernel", _moe),  # no decomposition: a dense one would read every expert
    # composites
    "swiglu": OpDef("composite", _pair, _swiglu, 2),
    "softcap": OpDef("composite", _same, _softcap, 1),
    "layer_norm": OpDef("composite", _norm, _layer_norm, 3),
    "norm_linear": OpDef("composite", _linear, _norm_linear, 3),
}


def infer_op(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    definition = OPS.get(op.kind)
    if definition is None:
        raise LinnetError(f"unknown op kind {op.kind!r}")
    return definition.infer(op, args, spec, act)


def features(program: Program) -> set[str]:
    """What a program asks of an emitter: its op kinds, and "sinks" where an attention reads them (what a
    backend's registry entry can say it does not run yet)."""
    ops = [op for section in program.sections().values() for op in section.ops]
    return {op.kind for op in ops} | {"sinks" for op in ops if op.attrs.get("sinks")}


def uncovered(native: set[str]) -> list[str]:
    """The ops an emitter that lowers ``native`` cannot lower, natively or by decomposition."""
    def covered(kind: str, seen: frozenset[str] = frozenset()) -> bool:
        if kind in native:
            return True
        definition = OPS[kind]
        if definition.decompose is None or kind in seen:
            return False
        probe = Op(kind, ("out",), tuple(f"in{i}" for i in range(definition.arity)),
                   {"cap": 1.0, "eps": 1e-6, "dtype": "f32"})
        return all(covered(o.kind, seen | {kind}) for o in definition.decompose(probe, lambda hint: hint))

    return [kind for kind in OPS if not covered(kind)]
