"""The Program's ops as standard ONNX operators (opset 18): the plain lowering, which every ONNX consumer
runs, and the base the ONNX Runtime variant's contrib forms build on (``contrib``).

An ``Emitter`` appends nodes to one graph, one Program op at a time (``op_<kind>``), each value named once
(SSA), as in the Program. Head counts and widths come from the Program's value types (``infer_types``):
a query [R, T, HEADS, D], a cache [ROWS, KV_HEADS, P, D].

Attention reads the cache in the ``gather`` form: any rows at any positions (the Program's whole step):
the step's rows are gathered from the cache, the new keys and values scattered into it (ScatterND), the
scores softcapped and masked per position (and window). A mixture of experts is a Loop over the experts
the step's tokens chose.

Arithmetic follows the Program: norms and attention in float32 (the mask is a ``Where`` over float32
scores, so nothing overflows in f16), products in the run dtype. ``compute`` may be wider than the run
dtype: where a provider lacks 16-bit kernels (bfloat16 on the CPU provider), values are held in float32
and rounded to the run dtype after every op that the Program rounds, so the numbers are the run dtype's
while the arithmetic runs where kernels exist.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import onnx
from onnx import TensorProto, helper

from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
from linnet.program import Op, Program, Section, Value

OPSET = 18
ONNX_TYPES = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16,
              "i64": TensorProto.INT64, "i32": TensorProto.INT32}
FLAT_AWARE = {"rotary", "cache_write", "attention"}  # ops that take per-head values flat (``Emitter.flat``)
ATTENTION_ATTRS = {"scale", "softcap", "window", "ring", "sinks"}

T = TypeVar("T")


@dataclass(frozen=True)
class GraphOptions:
    variant: str = "plain"  # "plain" | "ort"
    compute: str | None = None  # the dtype ops run in; None: the run dtype
    attention: str = "gather"  # "gather" | "gqa" (``contrib``)
    # gqa only: GroupQueryAttention's rows apart from the step's tokens (``passes.gathered_attention``), so that
    # a check of several rows' chunks of different lengths computes only their own positions
    ragged: bool = False


def refuse_unknown_attrs(op: Op, known: set[str], what: str) -> None:
    """An attr the emitter has no form of is an error naming it, never dropped."""
    unknown = sorted(set(op.attrs) - known)
    if unknown:
        raise LinnetError(f"the ONNX emitter has no form of {what}'s {', '.join(unknown)} (op {op})")


class Emitter:
    """Appends standard ONNX nodes to one graph; every value is named once (SSA), as in the Program."""

    contrib = False  # whether the graph uses ONNX Runtime's com.microsoft operators

    def __init__(self, program: Program, options: GraphOptions):
        self.program, self.spec = program, program.spec
        self.act = program.dtype
        self.compute = options.compute or program.dtype
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []
        self.names: set[str] = set()  # every value name taken, graph inputs and initializers included
        self._shared: dict[str, Any] = {}  # per-step values every layer reuses: names, or pairs of names
        self.weight_shapes: dict[str, tuple[int, ...]] = {}  # each weight's value name -> its shape
        self.lead_source = "tokens"
        self._flat: dict[str, tuple[str, int, int]] = {}  # a per-head value not yet reshaped -> (flat, heads, width)
        # sums of the residual stream held in the run dtype: a norm reading one may take the add in (``passes``)
        self.residual_sums: set[str] = set()
        self.types: dict[str, Value] = {}  # the section being emitted: each Program value's shape and dtype
        self.weight: Callable[[str], str] = str  # and its weights' graph names, by the section's names
        self.full_cache = "cache_k.0"  # a cache holding every position, whose length the causal mask takes

    def emit_section(self, section: Section, types: dict[str, Value], env: dict[str, str],
                     weight: Callable[[str], str]) -> None:
        self.types, self.weight = types, weight
        for op in section.ops:
            self.emit(op, env, weight)

    def rope_initializers(self, positions: int) -> list[onnx.TensorProto]:
        """The rotary tables: the Program's f32 [positions, ROTARY_DIM] tables, gathered per step."""
        from linnet.rope import rope_tables

        cos, sin = rope_tables(self.spec, positions)
        self.names.update({"rope_cos", "rope_sin"})
        return [onnx.numpy_helper.from_array(cos, "rope_cos"), onnx.numpy_helper.from_array(sin, "rope_sin")]

    # -- building blocks -------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        name, n = hint, 1
        while name in self.names:
            n += 1
            name = f"{hint}_{n}"
        self.names.add(name)
        return name

    def node(self, op: str, inputs: list[str], hint: str, domain: str = "", **attrs: Any) -> str:
        """A node with one output: its name."""
        return self.node_outs(op, inputs, hint, 1, domain, **attrs)[0]

    def node_outs(self, op: str, inputs: list[str], hint: str, outs: int, domain: str = "", **attrs: Any) -> list[str]:
        """A node with ``outs`` outputs: their names."""
        names = [self.fresh(hint if outs == 1 else f"{hint}_{k}") for k in range(outs)]
        self.nodes.append(helper.make_node(op, inputs, names, name=names[0], domain=domain or None, **attrs))
        return names

    def const(self, hint: str, value: np.ndarray) -> str:
        name = self.fresh(hint)
        self.constants.append(onnx.numpy_helper.from_array(np.asarray(value), name))
        return name

    def ints(self, *values: int) -> str:
        key = f"ints{values}"
        if key not in self._shared:
            self._shared[key] = self.const("ints", np.array(values, dtype=np.int64))
        return self._shared[key]

    def scalar(self, value: float, dtype: str) -> str:
        key = f"scalar{value}{dtype}"
        if key not in self._shared:
            array = np.array(value, dtype=np.float32)
            tensor = helper.make_tensor(self.fresh("scalar"), ONNX_TYPES[dtype], [], [float(array)])
            self.constants.append(tensor)
            self._shared[key] = tensor.name
        return self._shared[key]

    def cast(self, x: str, dtype: str, hint: str = "cast") -> str:
        return self.node("Cast", [x], hint, to=ONNX_TYPES[dtype])

    def rounded(self, x: str) -> str:
        """x rounded to the run dtype, where ops compute in a wider one."""
        if self.compute == self.act:
            return x
        return self.cast(self.cast(x, self.act, f"{x}_round"), self.compute, f"{x}_r")

    def to_f32(self, x: str) -> str:
        return x if self.compute == "f32" else self.cast(x, "f32", f"{x}_f32")

    def held(self, dtype: str) -> str:
        """The dtype the graph holds a Program value of ``dtype`` in."""
        return self.compute if dtype == self.act else dtype

    def out(self, op: Op, y: str) -> str:
        """An op's result, rounded to the run dtype where the Program's value is in it."""
        return self.rounded(y) if self.types[op.outs[0]].dtype == self.act else y

    def constant(self, value: float, dtype: str) -> str:
        """A scalar with a Program value's dtype: rounded to it, held as the graph holds that value."""
        return self.scalar(float(np.array(value, np.float32).astype(DTYPES[dtype].numpy)), self.held(dtype))

    # -- the Program's ops -----------------------------------------------------------------------
    def emit(self, op: Op, env: dict[str, str], weight: Callable[[str], str]) -> None:
        args = [weight(i[2:]) if i.startswith("w.") else env[i] for i in op.inputs]
        if op.kind not in FLAT_AWARE:
            args = [self.heads(a) for a in args]
        outs = getattr(self, f"op_{op.kind}")(op, *args)
        env.update(zip(op.outs, outs if isinstance(outs, list) else [outs]))

    def op_embedding(self, op: Op, tokens: str, table: str) -> str:
        return self.node("Gather", [table, tokens], "x", axis=0)

    def op_rms_norm(self, op: Op, x: str, w: str) -> str:
        return self.rounded(self.node("Mul", [w, self._rms_normed(x, op.attrs["eps"])], "norm"))

    def _rms_normed(self, x: str, eps: float) -> str:
        """x / rms(x) in float32, rounded to the run dtype: the RMS norm before its weight."""
        x32 = self.to_f32(x)
        mean = self.node("ReduceMean", [self.node("Mul", [x32, x32], "sq"), self.ints(-1)], "ms", keepdims=1)
        rms = self.node("Sqrt", [self.node("Add", [mean, self.scalar(eps, "f32")], "ms_eps")], "rms")
        scale = self.node("Reciprocal", [rms], "inv_rms")
        normed = self.rounded(self.node("Mul", [x32, scale], "normed"))
        return normed if self.compute == "f32" else self.cast(normed, self.compute, "normed_act")

    def op_rms_linear(self, op: Op, x: str, w: str, *rest: str) -> str:
        """The norm's weight folded into w, or apart (``norm``: the last input), then the product."""
        norm, bias = (rest[-1], rest[:-1]) if op.attrs.get("norm") else (None, rest)
        if norm is not None:
            return self.op_linear(op, self.op_rms_norm(op, x, norm), w, *bias)
        return self.op_linear(op, self._rms_normed(x, op.attrs["eps"]), w, *bias)

    def op_layer_norm(self, op: Op, x: str, w: str, b: str) -> str:
        """LayerNormalization over float32 values, rounded once to the Program's dtype."""
        y = self.node("LayerNormalization", [self.to_f32(x), self.to_f32(w), self.to_f32(b)], "layer_norm", axis=-1,
                      epsilon=op.attrs["eps"], stash_type=1)
        dtype = op.attrs["dtype"]
        return self.out(op, y if self.held(dtype) == "f32" else self.cast(y, self.held(dtype), "layer_norm_act"))

    def op_linear(self, op: Op, x: str, w: str, b: str | None = None) -> str:
        # Gemm reads w as stored ([out, in], transB): no transposed copy of any weight, a tied head included
        flat = self.node("Reshape", [x, self.ints(-1, self._width(w, in_axis=True))], "flat")
        y = self.node("Gemm", [flat, w, *([b] if b else [])], "gemm", transB=1)
        lead = self._leading(x)
        return self.rounded(self.node("Reshape", [y, self.node("Concat", [lead, self.ints(self._width(w))], "shape",
                                                               axis=0)], "linear"))

    def op_split(self, op: Op, x: str) -> list[str]:
        return self.node_outs("Split", [x, self.ints(*op.attrs["sizes"])], "part", len(op.outs), axis=-1)

    def op_split_heads(self, op: Op, x: str) -> str:
        return self.node("Reshape", [x, self.ints(0, 0, op.attrs["heads"], self.head_dim(op))], "heads")

    def head_dim(self, op: Op) -> int:
        """The width of each head split_heads makes: its result's last axis."""
        width = self.types[op.outs[0]].shape[-1]
        assert isinstance(width, int)
        return width

    def op_rotary(self, op: Op, x: str, positions: str, cos: str, sin: str) -> str:
        refuse_unknown_attrs(op, {"table"}, "rotary")
        width = self.types[op.inputs[0]].shape[-1]  # the head's, or its rotated part's
        assert isinstance(width, int)
        c, s = self._rope_gathered(op.attrs.get("table", 0), width)
        half = width // 2
        lo, hi = self.node_outs("Split", [x, self.ints(half, half)], "half", 2, axis=-1)
        rotated = self.node("Concat", [self.node("Neg", [hi], "neg"), lo], "rot_half", axis=-1)
        a = self.rounded(self.node("Mul", [x, c], "xc"))
        b = self.rounded(self.node("Mul", [rotated, s], "rs"))
        return self.rounded(self.node("Add", [a, b], "rot"))

    def op_cache_write(self, op: Op, cache: str, rows: str, positions: str, v: str) -> str:
        # named as the step's output, so that a caller binding one buffer as input and output updates it in place
        out = f"{cache}.out"
        self.names.add(out)
        ring = op.attrs.get("ring")
        at = "positions" if ring is None else self._ring_slots(ring, op.attrs["scratch"])
        index = self._scatter_index(self.kv_heads(op.inputs[0]), at)
        self.nodes.append(helper.make_node("ScatterND", [cache, index, self.heads(v)], [out], name=out))
        return out

    def op_attention(self, op: Op, q: str, cache_k: str, cache_v: str, rows: str, positions: str,
                     sinks: str | None = None) -> str:
        refuse_unknown_attrs(op, ATTENTION_ATTRS, "attention")
        _, _, heads, d = self.types[op.inputs[0]].shape  # q [R, T, HEADS, D]
        kv = self.kv_heads(op.inputs[1])
        assert isinstance(heads, int) and isinstance(d, int)
        group = heads // kv
        # queries grouped per key/value head: [R, KV, G * T, D]
        q = self._flat[q][0] if q in self._flat else q  # [R, T, H * D] or [R, T, H, D]: either reshapes
        grouped = self.node("Reshape", [q, self.ints(0, 0, kv, group, d)], "q_grouped")
        grouped = self.node("Transpose", [grouped], "q_t", perm=[0, 2, 3, 1, 4])
        grouped = self.to_f32(self.node("Reshape", [grouped, self.ints(0, kv, -1, d)], "q_kv"))
        keys = self._cache_f32(self.node("Gather", [cache_k, rows], "keys", axis=0))  # [R, KV, P, D]
        values = self._cache_f32(self.node("Gather", [cache_v, rows], "values", axis=0))
        scores = self.node("MatMul", [grouped, self.node("Transpose", [keys], "keys_t", perm=[0, 1, 3, 2])], "scores")
        scores = self.node("Mul", [scores, self.scalar(op.attrs["scale"], "f32")], "scaled")
        if "softcap" in op.attrs:  # cap * tanh(s / cap), before the mask
            cap = self.scalar(op.attrs["softcap"], "f32")
            bent = self.node("Tanh", [self.node("Div", [scores, cap], "capped_in")], "capped_tanh")
            scores = self.node("Mul", [bent, cap], "capped")
        visible = self._visible(group, op.attrs.get("window"), op.attrs.get("ring"), cache_k)
        masked = self.node("Where", [visible, scores, self.scalar(-math.inf, "f32")], "masked")
        if sinks is not None:  # each head's sink: one more logit, a column that weighs no value
            masked = self.node("Concat", [masked, self._sink_column(sinks, kv, group, masked)], "with_sinks", axis=-1)
        weights = self.node("Softmax", [masked], "probs", axis=-1)
        if sinks is not None:
            weights = self.node("Slice", [weights, self.ints(0), self.ints(-1), self.ints(-1)], "probs_keys")
        out = self.node("MatMul", [weights, values], "attn_kv")  # [R, KV, G * T, D]
        out = self.node("Reshape", [out, self.ints(0, kv, group, -1, d)], "attn_g")
        out = self.node("Transpose", [out], "attn_t", perm=[0, 3, 1, 2, 4])  # [R, T, KV, G, D]
        out = self.node("Reshape", [out, self.ints(0, 0, heads * d)], "attn_merged")
        return self.rounded(out if self.compute == "f32" else self.cast(out, self.compute, "attn"))

    def kv_heads(self, cache: str) -> int:
        """A cache's key/value heads: its type's second axis ([ROWS, KV_HEADS, P, D])."""
        kv = self.types[cache].shape[1]
        assert isinstance(kv, int)
        return kv

    def op_swiglu(self, op: Op, gate: str, up: str) -> str:
        silu = self.rounded(self.node("Mul", [gate, self.node("Sigmoid", [gate], "sig")], "silu"))
        return self.rounded(self.node("Mul", [silu, up], "swiglu"))

    def op_activation(self, op: Op, x: str) -> str:
        fn = op.attrs["fn"]
        if fn == "silu":
            return self.rounded(self.node("Mul", [x, self.node("Sigmoid", [x], "sig")], "silu"))
        x32 = self.to_f32(x)  # GELUs in float32: opset 18 has no Gelu, and erf and tanh round least there
        if fn == "gelu":  # x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))
            inner = self.node("Erf", [self.node("Mul", [x32, self.scalar(math.sqrt(0.5), "f32")], "gelu_in")], "erf")
        elif fn == "gelu_tanh":  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
            cube = self.node("Mul", [self.node("Mul", [x32, x32], "sq"), x32], "cube")
            poly = self.node("Add", [x32, self.node("Mul", [cube, self.scalar(0.044715, "f32")], "cube_k")], "poly")
            inner = self.node("Tanh", [self.node("Mul", [poly, self.scalar(math.sqrt(2 / math.pi), "f32")], "tanh_in")],
                              "tanh")
        else:
            raise LinnetError(f"the ONNX emitter has no activation {fn!r} (op {op})")
        half = self.node("Mul", [x32, self.scalar(0.5, "f32")], "half_x")
        y = self.node("Mul", [half, self.node("Add", [inner, self.scalar(1.0, "f32")], "one_plus")], "gelu")
        return self.rounded(y if self.compute == "f32" else self.cast(y, self.compute, "gelu_act"))

    def op_add(self, op: Op, a: str, b: str) -> str:
        total = self.node("Add", [a, b], "sum")
        if self.compute != self.act or self.types[op.outs[0]].dtype != self.act:
            return self.out(op, total)
        self.residual_sums.add(total)  # a norm that reads it next may take the add in (``passes``)
        return total

    def op_sub(self, op: Op, a: str, b: str) -> str:
        return self.out(op, self.node("Sub", [a, b], "diff"))

    def op_mul(self, op: Op, a: str, b: str) -> str:
        return self.out(op, self.node("Mul", [a, b], "prod"))

    def op_scale(self, op: Op, x: str) -> str:
        return self.out(op, self.node("Mul", [x, self.constant(op.attrs["factor"], self.types[op.inputs[0]].dtype)],
                                      "scaled"))

    def op_shift(self, op: Op, x: str) -> str:
        return self.out(op, self.node("Add", [x, self.constant(op.attrs["amount"], self.types[op.inputs[0]].dtype)],
                                      "shifted"))

    def op_softcap(self, op: Op, x: str) -> str:
        """cap * tanh(x / cap), each step rounded: a division by cap, where the decomposition's factor 1 / cap
        would be rounded to the run dtype first (0.2% off in bfloat16 for a cap of 3)."""
        cap = self.constant(op.attrs["cap"], self.types[op.inputs[0]].dtype)
        bent = self.out(op, self.node("Tanh", [self.out(op, self.node("Div", [x, cap], "cap_in"))], "cap_tanh"))
        return self.out(op, self.node("Mul", [bent, cap], "capped"))

    def op_tanh(self, op: Op, x: str) -> str:
        return self.out(op, self.node("Tanh", [x], "tanh"))

    def op_rsqrt(self, op: Op, x: str) -> str:
        return self.out(op, self.node("Reciprocal", [self.node("Sqrt", [x], "sqrt")], "rsqrt"))

    def op_mean(self, op: Op, x: str) -> str:
        return self.out(op, self.node("ReduceMean", [x, self.ints(-1)], "mean", keepdims=1))

    def op_concat(self, op: Op, *parts: str) -> str:
        return self.node("Concat", list(parts), "concat", axis=-1)

    def op_select(self, op: Op, x: str, select: str) -> str:
        index = self.node("Unsqueeze", [select, self.ints(-1)], "sel_index")
        width = self.types[op.inputs[0]].shape[-1]
        assert isinstance(width, int)
        shape = self.node("Concat", [self.node("Shape", [select], "sel_shape"), self.ints(width)],
                          "sel_full", axis=0)
        return self.node("GatherElements", [x, self.node("Expand", [index, shape], "sel_expanded")], "x_sel", axis=1)

    def op_cast(self, op: Op, x: str) -> str:
        source, target = self.held(self.types[op.inputs[0]].dtype), self.held(op.attrs["dtype"])
        y = x if source == target else self.cast(x, target, "cast")
        return self.out(op, y) if op.attrs["dtype"] != self.types[op.inputs[0]].dtype else y

    def _sink_column(self, sinks: str, kv: int, group: int, scores: str) -> str:
        """[R, KV, G * T, 1]: each query's head's sink logit beside its scores [R, KV, G * T, P] (g-major)."""
        column = self.node("Reshape", [self.to_f32(sinks), self.ints(1, kv, group, 1)], "sinks_g")
        length = self.node("Shape", ["positions"], "t_len", start=1, end=2)
        column = self.node("Expand", [column, self.node("Concat", [self.ints(1, kv, group), length], "sinks_gt_shape",
                                                         axis=0)], "sinks_gt")
        column = self.node("Reshape", [column, self.ints(1, kv, -1, 1)], "sinks_rows")
        shape = self.node("Concat", [self.node("Shape", [scores], "scores_lead", end=3), self.ints(1)], "sinks_shape",
                          axis=0)
        return self.node("Expand", [column, shape], "sinks_column")

    # -- the mixture of experts --------------------------------------------------------------------
    def op_moe(self, op: Op, x: str, router: str, gate: str, up: str, down: str, *biases: str) -> str:
        """The Program's ``moe``, sparse: the router's logits, then the experts the step's tokens chose
        (``experts``)."""
        attrs = op.attrs
        logits = self.op_linear(op, x, router, *biases[:1] if attrs.get("router_bias") else ())
        expert_biases = biases[-3:] if attrs.get("expert_bias") else (None, None, None)
        return self.experts(op, x, logits, (gate, up, down), expert_biases)

    def experts(self, op: Op, x: str, logits: str, stacks: tuple[str, str, str],
                biases: tuple[str | None, ...]) -> str:
        """Standard operators: each token's top k (TopK: equal scores, the lower index first) and their
        weights; then a Loop over the experts some token chose (Unique: ascending), whose body gathers
        that expert's matrices alone, runs them on the tokens that chose it (NonZero) and adds each output
        times its weight to the token's sum (ScatterND, reduction add)."""
        attrs = op.attrs
        width, experts = (int(self.types[op.inputs[i]].shape[j]) for i, j in ((0, -1), (1, 0)))
        tokens = self.node("Reshape", [x, self.ints(-1, width)], "moe_tokens")
        scores = self.node("Reshape", [self.to_f32(logits), self.ints(-1, experts)], "router_scores")
        if attrs["gating"] == "softmax_topk":
            scores = self.node("Softmax", [scores], "router_probs", axis=-1)
        weights, chosen = self.node_outs("TopK", [scores, self.ints(attrs["top_k"])], "picks", 2, axis=-1)
        if attrs["gating"] == "topk_softmax":
            weights = self.node("Softmax", [weights], "pick_weights", axis=-1)
        elif attrs.get("normalize"):
            total = self.node("ReduceSum", [weights, self.ints(-1)], "pick_total", keepdims=1)
            weights = self.node("Div", [weights, total], "pick_weights")
        weights = self.rounded(weights if self.compute == "f32" else self.cast(weights, self.compute, "pick_weights"))
        used = self.node("Unique", [self.node("Reshape", [chosen, self.ints(-1)], "picks_flat")], "chosen", sorted=1)
        zero = helper.make_tensor("zero", ONNX_TYPES[self.compute], [1], [0.0])
        start = self.node("ConstantOfShape", [self.node("Shape", [tokens], "moe_shape")], "moe_zeros", value=zero)

        outer, self.nodes = self.nodes, []  # the body's nodes (outer values are read as they are)
        i, keep, summed = self.fresh("moe_i"), self.fresh("moe_keep"), self.fresh("moe_sum")
        e = self.node("Gather", [used, i], "expert", axis=0)
        picks = self.node("NonZero", [self.node("Equal", [chosen, e], "chose_expert")], "expert_picks")  # [2, M]
        token = self.node("Gather", [picks, self._zero()], "expert_tokens", axis=0)
        weight = self.node("GatherND", [weights, self.node("Transpose", [picks], "expert_pick_index", perm=[1, 0])],
                           "expert_weights")

        def linear(h: str, stack: str, bias: str | None) -> str:  # expert e's matrix, gathered alone
            parts = [self.node("Gather", [s, e], "expert_part", axis=0) for s in (stack, bias) if s is not None]
            return self.rounded(self.node("Gemm", [h, *parts], "expert_product", transB=1))

        h = self.node("Gather", [tokens, token], "expert_x", axis=0)
        (gate, up, down), (gate_b, up_b, down_b) = stacks, biases
        y = linear(self._expert_activation(op, linear(h, gate, gate_b), linear(h, up, up_b)), down, down_b)
        y = self.rounded(self.node("Mul", [y, self.node("Unsqueeze", [weight, self.ints(-1)], "expert_weight")],
                                   "expert_out"))
        rows = self.node("Unsqueeze", [token, self.ints(-1)], "expert_rows")
        added = self.rounded(self.node("ScatterND", [summed, rows, y], "expert_added", reduction="add"))
        still = self.node("Identity", [keep], "moe_keep_out")
        body_nodes, self.nodes = self.nodes, outer
        held = ONNX_TYPES[self.compute]
        body = helper.make_graph(
            body_nodes, self.fresh("moe_experts"),
            [helper.make_tensor_value_info(i, TensorProto.INT64, []),
             helper.make_tensor_value_info(keep, TensorProto.BOOL, []),
             helper.make_tensor_value_info(summed, held, [None, width])],
            [helper.make_tensor_value_info(still, TensorProto.BOOL, []),
             helper.make_tensor_value_info(added, held, [None, width])])
        out = self.node("Loop", [self.node("Size", [used], "chosen_count"), "", start], "moe_out", body=body)
        return self.node("Reshape", [out, self.node("Shape", [x], "moe_x_shape")], "moe")

    def _expert_activation(self, op: Op, g: str, u: str) -> str:
        """silu(g) * u ("swiglu"), or g' sigmoid(alpha g') (u' + 1), g' = min(g, limit) and u' clamped
        to [-limit, limit] ("clamped_swiglu")."""
        if op.attrs["activation"] == "swiglu":
            return self.op_swiglu(op, g, u)
        act = self.types[op.outs[0]].dtype
        limit, alpha = self.constant(op.attrs["limit"], act), self.constant(op.attrs["alpha"], act)
        g = self.node("Min", [g, limit], "gate_clamped")
        u = self.node("Clip", [u, self.node("Neg", [limit], "neg_limit"), limit], "up_clamped")
        sig = self.node("Sigmoid", [self.rounded(self.node("Mul", [g, alpha], "gate_alpha"))], "gate_sig")
        gated = self.rounded(self.node("Mul", [g, self.rounded(sig)], "gated"))
        return self.rounded(self.node("Mul", [gated, self.rounded(self.node("Add", [u, self.constant(1.0, act)],
                                                                            "up_plus"))], "clamped_swiglu"))
    # -- per-head values kept flat ----------------------------------------------------------------
    def flat_heads(self, flat: str, heads: int, width: int) -> str:
        """A name for ``flat`` [R, T, heads * width] seen as [R, T, heads, width]; no node until ``heads`` asks."""
        name = self.fresh(f"{flat}_heads")
        self._flat[name] = (flat, heads, width)
        return name

    def heads(self, x: str) -> str:
        """``x`` as [R, T, heads, D] (the reshape emitted once, where first needed)."""
        if x not in self._flat:
            return x
        flat, heads, width = self._flat[x]
        return self._once(f"heads:{x}", lambda: self._reshape_to(x, flat, heads, width))

    def flat(self, x: str) -> str:
        """``x`` as [R, T, heads * D]."""
        if x in self._flat:
            return self._flat[x][0]
        return self.node("Reshape", [x, self.ints(0, 0, -1)], "flat")

    def _reshape_to(self, name: str, flat: str, heads: int, width: int) -> str:
        self.nodes.append(helper.make_node("Reshape", [flat, self.ints(0, 0, heads, width)], [name], name=name))
        return name

    # -- per-step values, built once and shared by every layer ----------------------------------
    def _once(self, key: str, build: Callable[[], T]) -> T:
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]

    def _rope_gathered(self, index: int = 0, width: int = 0) -> tuple[str, str]:
        """The rotary tables at the step's positions, [R, T, 1, D], gathered once per step; with several
        tables side by side, table ``index``'s columns (``width`` each), cut once."""
        def table(name: str) -> str:
            gathered = self.node("Gather", [f"rope_{name}", "positions"], f"{name}_pos", axis=0)  # [R, T, D]
            gathered = self.node("Unsqueeze", [gathered, self.ints(2)], f"{name}_heads")
            return self.rounded(gathered if self.compute == "f32" else self.cast(gathered, self.compute, name))

        c, s = self._once("cos", lambda: table("cos")), self._once("sin", lambda: table("sin"))
        if self.spec.rope_table_count == 1:
            return c, s
        bounds = [self.ints(index * width), self.ints((index + 1) * width), self.ints(-1)]

        def cut(name: str, gathered: str) -> str:
            return self._once(f"{name}:{index}",
                              lambda: self.node("Slice", [gathered, *bounds], f"{name}_table{index}"))
        return cut("cos", c), cut("sin", s)

    def _scatter_index(self, kv: int, at: str = "positions") -> str:
        """[R, T, KV, 3] indices (rows[r], head, at[r, t]) into a [ROWS, KV, P, D] cache: at the positions,
        or a ring's slots."""
        def build() -> str:
            shape = self.node("Concat", [self.node("Shape", ["positions"], "rt"), self.ints(kv, 1)], "rtk1", axis=0)
            rows = self.node("Reshape", ["rows", self.ints(-1, 1, 1, 1)], "rows_b")
            heads = self.const("kv_heads", np.arange(kv, dtype=np.int64).reshape(1, 1, kv, 1))
            positions = self.node("Unsqueeze", [at, self.ints(2, 3)], "pos_b")
            parts = [self.node("Expand", [p, shape], "index_part") for p in (rows, heads, positions)]
            return self.node("Concat", parts, "scatter_index", axis=-1)
        return self._once(f"scatter_index:{kv}" if at == "positions" else f"scatter_index:{kv}:{at}", build)

    def _ring_slots(self, ring: int, scratch: int) -> str:
        """[R, T]: where a ring cache of ``ring`` slots takes each position: p mod ring, the scratch
        position at slot ring."""
        def build() -> str:
            size = self.const("ring", np.array(ring, np.int64))
            wrapped = self.node("Mod", ["positions", size], "ring_wrapped")
            scratch_position = self.const("scratch", np.array(scratch, np.int64))
            scratched = self.node("Equal", ["positions", scratch_position], "scratched")
            return self.node("Where", [scratched, size, wrapped], "ring_slots")
        return self._once(f"ring_slots:{ring}", build)

    def _visible(self, group: int, window: int | None, ring: int | None = None, cache: str = "") -> str:
        """[R, 1, G * T, P] bool: cache position p is visible to the query at (g, t) when p <= positions[t]
        (and, with a window W, p > positions[t] - W). In a ring (``cache``'s) of N slots, slot s < N holds
        the key age = (q - s) mod N back, visible where age < W and age <= q."""
        def keys(source: str = self.full_cache) -> str:
            length = self.node("Shape", [source], "cache_len", start=2, end=3)
            return self.node("Range", [self._zero(), self.node("Squeeze", [length], "p_len"), self._one()], "p")

        def ring_build() -> str:  # q - s + N is never negative: any sign convention of Mod will do
            s, q = self._once(f"ring_keys:{ring}", lambda: keys(cache)), self._once("query_positions", queries)
            size = self.const("ring", np.array(ring, np.int64))
            age = self.node("Mod", [self.node("Add", [self.node("Sub", [q, s], "q_minus_s"), size], "ahead"), size],
                            "age")
            seen = self.node("And", [self.node("Less", [s, size], "in_ring"),
                                     self.node("Less", [age, self.const("window", np.array(window, np.int64))],
                                               "in_window")], "ring_window")
            return self.node("And", [seen, self.node("LessOrEqual", [age, q], "after_start")], "visible_ring")

        def queries() -> str:
            q = self.node("Tile", ["positions", self.ints(1, group)], "q_pos")  # [R, G * T], g-major as the queries
            return self.node("Unsqueeze", [q, self.ints(1, 3)], "q_b")

        def build() -> str:
            p, q = self._once("key_positions", keys), self._once("query_positions", queries)
            causal = self.node("LessOrEqual", [p, q], "visible")
            if window is None:
                return causal
            first = self.node("Sub", [q, self.const("window", np.array(window, np.int64))], "window_start")
            return self.node("And", [causal, self.node("Greater", [p, first], "in_window")], "visible_window")
        if ring is not None:
            return self._once(f"visible:{window}:ring{ring}", ring_build)
        return self._once(f"visible:{window}", build)

    def _zero(self) -> str:
        return self._once("zero", lambda: self.const("zero", np.array(0, dtype=np.int64)))

    def _one(self) -> str:
        return self._once("one", lambda: self.const("one", np.array(1, dtype=np.int64)))

    def _cache_f32(self, x: str) -> str:
        return x if self.compute == "f32" else self.cast(x, "f32", f"{x}_f32")

    def _leading(self, x: str) -> str:
        """[R, T] in the layers, [R, S] in the head: the leading axes every activation there shares."""
        source = self.lead_source
        return self._once(f"lead:{source}", lambda: self.node("Shape", [source], "lead"))

    def _width(self, w: str, in_axis: bool = False) -> int:
        return self.weight_shapes[w][1 if in_axis else 0]
