"""The Program's step as an ONNX graph, built node by node with ``onnx.helper`` (no tracing).

The graph is the whole batched step (``linnet.program``):

    step(tokens [R, T], positions [R, T], rows [R], select [R, S], cache_k.<i>, cache_v.<i>)
        -> logits [R, S, VOCAB] f32, next_ids [R, S] i64 (the argmax), cache_k.<i>.out, cache_v.<i>.out

with one ``[ROWS, KV_HEADS, P, HEAD_DIM]`` cache per layer, ``P`` free, and the rotary tables and the
weights as initializers. Two variants of one emitter:

- ``plain``: standard ONNX operators only (opset 18), for any ONNX consumer.
- ``ort``: ONNX Runtime's contrib operators where they replace several plain ones:
  SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization (norm and residual add in one pass,
  accumulated in float32), com.microsoft RotaryEmbedding, and FusedMatMul, which reads a weight as
  stored ([out, in]) from activations of any rank, so that no reshape surrounds a product. Per-head
  values stay flat ([R, T, heads * D]) until an op needs the heads apart.

Attention reads the cache in one of two ways:

- ``gather``: any rows at any positions (the Program's whole step): the step's rows are gathered from
  the cache, the new keys and values scattered into it (ScatterND), the scores softcapped and masked
  per position (and window).
- ``gqa`` (``ort`` only): com.microsoft GroupQueryAttention over cache rows bound in order (the runner
  binds a window of them), which appends the new keys and values and reads only the valid length, in
  one kernel (its scale, softcap and local_window_size attributes are the Program's attrs). It places
  the new tokens at each row's length, so each step's positions must be contiguous
  (``positions[t] = positions[0] + t``): the runner sees to that.

Rotary on part of each head (x narrower than HEAD_DIM) is a rotation of that part alone: tables of
ROTARY_DIM, and GroupQueryAttention's own rotation (whole heads) left out.

Matrices the Program holds in llama.cpp's blocks (``ort`` only) are com.microsoft MatMulNBits products
and GatherBlockQuantized rows on their codes (``blocks``), with ``Program.int8_activations`` as
MatMulNBits' accuracy level 4.

Each layer is emitted inline with its kind's section (``Program.layer_section``). Composites without a
form here (``NATIVE_OPS``) arrive as their decompositions (``linnet.program.lower``).

Arithmetic follows the Program: norms and attention in float32 (the mask is a ``Where`` over float32
scores, so nothing overflows in f16), products in the run dtype. ``compute`` may be wider than the
run dtype: where a provider lacks 16-bit kernels (bfloat16 on the CPU provider), values are held in
float32 and rounded to the run dtype after every op that the Program rounds, so the numbers are the
run dtype's while the arithmetic runs where kernels exist.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import onnx
from onnx import TensorProto, helper

from linnet.backends.onnx.blocks import PARTS, bits, block_size
from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
from linnet.program import Op, Program, Section, Value, infer_types, layer_section_name, lower
from linnet.quantize import block_names

OPSET = 18
ONNX_TYPES = {"f32": TensorProto.FLOAT, "f16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16,
              "i64": TensorProto.INT64, "i32": TensorProto.INT32}
FLAT_AWARE = {"rotary", "cache_write", "attention"}  # ops that take per-head values flat (``_Emitter.flat``)
# The ops emitted here: every primitive and kernel, and the composites with a form of their own (SwiGLU as
# one Mul of a Sigmoid, LayerNorm as LayerNormalization, softcap dividing by its cap); norm_linear arrives
# decomposed.
NATIVE_OPS = frozenset({
    "embedding", "linear", "split", "concat", "split_heads", "cache_write", "select", "cast", "add", "sub", "mul",
    "scale", "shift", "tanh", "rsqrt", "mean", "activation",
    "rms_norm", "rotary", "attention", "rms_linear",
    "swiglu", "layer_norm", "softcap", "moe"})
ATTENTION_ATTRS = {"scale", "softcap", "window", "ring", "sinks"}

# ONNX Runtime's MoE kernel reads each expert's gate and up rows interleaved in one matrix (row 2j gate's row
# j, row 2j + 1 up's): the weights hold that form beside the Program's stacks (``export.planned_arrays``).
INTERLEAVED = {"expert_gate_up": ("expert_gate", "expert_up"),
               "expert_gate_up_bias": ("expert_gate_bias", "expert_up_bias")}

T = TypeVar("T")


@dataclass(frozen=True)
class GraphOptions:
    variant: str = "plain"  # "plain" | "ort"
    compute: str | None = None  # the dtype ops run in; None: the run dtype
    attention: str = "gather"  # "gather" | "gqa" (see the module's docstring)


@dataclass(frozen=True)
class BlockWeight:
    """A matrix [n, k] in one of llama.cpp's block forms, as MatMulNBits' initializers (``blocks.PARTS``)."""
    form: str
    n: int
    k: int
    parts: dict[str, str]  # part -> initializer name


class _Emitter:
    """Appends nodes to one graph; every value is named once (SSA), as in the Program."""

    def __init__(self, program: Program, options: GraphOptions):
        self.program, self.spec = program, program.spec
        self.act = program.dtype
        self.compute = options.compute or program.dtype
        self.contrib = options.variant == "ort"
        self.gqa = options.attention == "gqa"
        if self.gqa and not self.contrib:
            raise ValueError("GroupQueryAttention is an ONNX Runtime contrib operator: it needs the ort variant")
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []
        self._names: set[str] = set()
        self._shared: dict[str, Any] = {}  # per-step values every layer reuses: names, or pairs of names
        self.weight_shapes: dict[str, tuple[int, ...]] = {}  # each weight's value name -> its shape
        self.lead_source = "tokens"
        self._flat: dict[str, tuple[str, int, int]] = {}  # a per-head value not yet reshaped -> (flat, heads, width)
        self._appended: dict[str, tuple[str, str]] = {}  # gqa: a cache's output -> (the cache, the flat new values)
        self._residuals: set[str] = set()  # sums of the residual stream, in the run dtype
        self.blocks: dict[str, BlockWeight] = {}  # a weight's name -> its blocks, for a matrix in blocks
        # MatMulNBits' accuracy level 4 rounds x to int8 per block, as Program.int8_activations defines
        self.block_accuracy = 4 if program.int8_activations else 0
        self.types: dict[str, Value] = {}  # the section being emitted: each Program value's shape and dtype
        self.weight: Callable[[str], str] = str  # and its weights' graph names, by the section's names
        self.full_cache = "cache_k.0"  # a cache holding every position, whose length the causal mask takes

    def emit_section(self, section: Section, types: dict[str, Value], env: dict[str, str], weight) -> None:
        self.types, self.weight = types, weight
        for op in section.ops:
            self.emit(op, env, weight)

    # -- building blocks -------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        name, n = hint, 1
        while name in self._names:
            n += 1
            name = f"{hint}_{n}"
        self._names.add(name)
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
    def emit(self, op: Op, env: dict[str, str], weight) -> None:
        args = [weight(i[2:]) if i.startswith("w.") else env[i] for i in op.inputs]
        if op.kind not in FLAT_AWARE:
            args = [self.heads(a) for a in args]
        outs = getattr(self, f"op_{op.kind}")(op, *args)
        env.update(zip(op.outs, outs if isinstance(outs, list) else [outs]))

    def op_embedding(self, op: Op, tokens: str, table: str) -> str:
        if table in self.blocks:
            return self._block_gather(self.blocks[table], tokens)
        return self.node("Gather", [table, tokens], "x", axis=0)

    def op_rms_norm(self, op: Op, x: str, w: str) -> str:
        eps = op.attrs["eps"]
        if self.contrib:  # accumulates in float32 for every input type (stash_type 1)
            last = self.nodes[-1]
            if last.op_type == "Add" and last.output[0] == x and x in self._residuals:  # add and norm in one pass
                self.nodes.pop()
                norm = self.fresh("norm")
                self.nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [*last.input, w],
                                                   [norm, "", "", x], name=norm, domain="com.microsoft", epsilon=eps))
                return norm
            return self.rounded(self.node("SimplifiedLayerNormalization", [x, w], "norm", axis=-1, epsilon=eps))
        return self.rounded(self.node("Mul", [w, self._rms_normed(x, eps)], "norm"))

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
        if w in self.blocks:
            y = self._block_matmul(self.blocks[w], x)
            return self.rounded(self.node("Add", [y, b], "biased") if b else y)
        if self.contrib:  # [..., in] x [out, in]^T, any leading axes
            y = self.node("FusedMatMul", [x, w], "matmul", domain="com.microsoft", transB=1)
            return self.rounded(self.node("Add", [y, b], "biased") if b else y)
        # Gemm reads w as stored ([out, in], transB): no transposed copy of any weight, a tied head included
        flat = self.node("Reshape", [x, self.ints(-1, self._width(w, in_axis=True))], "flat")
        y = self.node("Gemm", [flat, w, *([b] if b else [])], "gemm", transB=1)
        lead = self._leading(x)
        return self.rounded(self.node("Reshape", [y, self.node("Concat", [lead, self.ints(self._width(w))], "shape",
                                                               axis=0)], "linear"))

    def op_split(self, op: Op, x: str) -> list[str]:
        return self.node_outs("Split", [x, self.ints(*op.attrs["sizes"])], "part", len(op.outs), axis=-1)

    def op_split_heads(self, op: Op, x: str) -> str:
        if self.contrib:  # reshaped only if an op needs the heads apart (``heads``)
            return self.flat_heads(x, op.attrs["heads"], self.spec.head_dim)
        return self.node("Reshape", [x, self.ints(0, 0, op.attrs["heads"], self.spec.head_dim)], "heads")

    def op_rotary(self, op: Op, x: str, positions: str, cos: str, sin: str) -> str:
        unknown = sorted(set(op.attrs) - {"table"})
        if unknown:
            raise LinnetError(f"the ONNX emitter has no form of rotary's {', '.join(unknown)} (op {op})")
        _, _, heads, width = self.types[op.inputs[0]].shape  # width: the head's, or its rotated part's
        assert isinstance(heads, int) and isinstance(width, int)
        table = op.attrs.get("table", 0)
        if self.contrib:  # com.microsoft RotaryEmbedding: [R, T, heads, D] as [R, T, heads * D]
            cos_half, sin_half = self._shared[_half_name("cos", table)], self._shared[_half_name("sin", table)]
            y = self.node("RotaryEmbedding", [self.flat(x), positions, cos_half, sin_half], "rot",
                          domain="com.microsoft", interleaved=0, num_heads=heads)
            return self.flat_heads(self.rounded(y), heads, width)
        c, s = self._rope_gathered(table, width)
        half = width // 2
        lo, hi = self.node_outs("Split", [x, self.ints(half, half)], "half", 2, axis=-1)
        rotated = self.node("Concat", [self.node("Neg", [hi], "neg"), lo], "rot_half", axis=-1)
        a = self.rounded(self.node("Mul", [x, c], "xc"))
        b = self.rounded(self.node("Mul", [rotated, s], "rs"))
        return self.rounded(self.node("Add", [a, b], "rot"))

    def op_cache_write(self, op: Op, cache: str, rows: str, positions: str, v: str) -> str:
        # named as the step's output, so that a caller binding one buffer as input and output updates it in place
        out = f"{cache}.out"
        self._names.add(out)
        ring = op.attrs.get("ring")
        if self.gqa and ring is None:  # GroupQueryAttention appends them (op_attention)
            self._appended[out] = (cache, self.flat(v))
            return out
        at = "positions" if ring is None else self._ring_slots(ring, op.attrs["scratch"])
        index = self._scatter_index(at)
        self.nodes.append(helper.make_node("ScatterND", [cache, index, self.heads(v)], [out], name=out))
        return out

    def op_attention(self, op: Op, q: str, cache_k: str, cache_v: str, rows: str, positions: str,
                     sinks: str | None = None) -> str:
        unknown = sorted(set(op.attrs) - ATTENTION_ATTRS)
        if unknown:
            raise LinnetError(f"the ONNX emitter has no form of attention's {', '.join(unknown)} (op {op})")
        spec = self.spec
        heads, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        if self.gqa and "ring" not in op.attrs:  # a ring is beyond GroupQueryAttention: the plain form reads it
            return self._group_query_attention(op, q, cache_k, cache_v, sinks)
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
            masked = self.node("Concat", [masked, self._sink_column(sinks, group, masked)], "with_sinks", axis=-1)
        weights = self.node("Softmax", [masked], "probs", axis=-1)
        if sinks is not None:
            weights = self.node("Slice", [weights, self.ints(0), self.ints(-1), self.ints(-1)], "probs_keys")
        out = self.node("MatMul", [weights, values], "attn_kv")  # [R, KV, G * T, D]
        out = self.node("Reshape", [out, self.ints(0, kv, group, -1, d)], "attn_g")
        out = self.node("Transpose", [out], "attn_t", perm=[0, 3, 1, 2, 4])  # [R, T, KV, G, D]
        out = self.node("Reshape", [out, self.ints(0, 0, heads * d)], "attn_merged")
        return self.rounded(out if self.compute == "f32" else self.cast(out, self.compute, "attn"))

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
        self._residuals.add(total)  # a norm that reads it next may take the add in (op_rms_norm)
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
        shape = self.node("Concat", [self.node("Shape", [select], "sel_shape"), self.ints(self.spec.hidden_size)],
                          "sel_full", axis=0)
        return self.node("GatherElements", [x, self.node("Expand", [index, shape], "sel_expanded")], "x_sel", axis=1)

    def op_cast(self, op: Op, x: str) -> str:
        source, target = self.held(self.types[op.inputs[0]].dtype), self.held(op.attrs["dtype"])
        y = x if source == target else self.cast(x, target, "cast")
        return self.out(op, y) if op.attrs["dtype"] != self.types[op.inputs[0]].dtype else y

    def _block_matmul(self, w: BlockWeight, x: str) -> str:
        """x [R, T, k] times a matrix in blocks: com.microsoft MatMulNBits on its codes (``blocks``); for
        a form with mins, plus each block's min times the block's sum of x."""
        zero_points = [w.parts["zero_points"]] if "zero_points" in w.parts else []
        size = block_size(w.form)
        y = self.node("MatMulNBits", [x, w.parts["codes"], w.parts["scales"], *zero_points], "matmul_blocks",
                      domain="com.microsoft", K=w.k, N=w.n, bits=bits(w.form), block_size=size,
                      accuracy_level=self.block_accuracy)
        if "mins" not in w.parts:
            return y
        per_block = self.node("Reshape", [x, self.ints(0, 0, w.k // size, size)], "x_blocks")
        sums = self.node("ReduceSum", [per_block, self.ints(-1)], "x_block_sums", keepdims=0)
        mins = self.node("FusedMatMul", [sums, w.parts["mins"]], "matmul_mins", domain="com.microsoft", transB=1)
        return self.node("Add", [y, mins], "matmul_mins_added")

    def _block_gather(self, w: BlockWeight, tokens: str) -> str:
        """Rows of a matrix in blocks: com.microsoft GatherBlockQuantized on the codes MatMulNBits reads
        ([n, k / block, block * bits / 8], each block's scale on an axis of its own), then [R, T, k]."""
        scales = self.node("Unsqueeze", [w.parts["scales"], self.ints(-1)], "embed_scales")
        size, width = block_size(w.form), bits(w.form)
        zero_points = []
        if "zero_points" in w.parts and width == 8:  # one a byte: the same values on an axis of their own
            zero_points = [self.node("Unsqueeze", [w.parts["zero_points"], self.ints(-1)], "embed_zero_points")]
        elif "zero_points" in w.parts:  # 4 bits: the forms with mins, whose zero points are 0
            zero_points = [self.const("embed_zero_points", np.zeros((w.n, w.k // size, 1), np.uint8))]
        rows = self.node("GatherBlockQuantized", [w.parts["codes"], tokens, scales, *zero_points], "x_blocks",
                         domain="com.microsoft", bits=width, block_size=size, gather_axis=0, quantize_axis=2)
        if "mins" in w.parts:  # [R, T, k / block, block] + [R, T, k / block, 1]
            mins = self.node("Gather", [w.parts["mins"], tokens], "x_mins", axis=0)
            rows = self.node("Add", [rows, self.node("Unsqueeze", [mins, self.ints(-1)], "x_mins_b")], "x_with_mins")
        return self.node("Reshape", [rows, self.ints(0, 0, w.k)], "x")

    def _sink_column(self, sinks: str, group: int, scores: str) -> str:
        """[R, KV, G * T, 1]: each query's head's sink logit beside its scores [R, KV, G * T, P] (g-major)."""
        kv = self.spec.num_kv_heads
        column = self.node("Reshape", [self.to_f32(sinks), self.ints(1, kv, group, 1)], "sinks_g")
        length = self.node("Shape", ["positions"], "t_len", start=1, end=2)
        column = self.node("Expand", [column, self.node("Concat", [self.ints(1, kv, group), length], "sinks_gt_shape",
                                                         axis=0)], "sinks_gt")
        column = self.node("Reshape", [column, self.ints(1, kv, -1, 1)], "sinks_rows")
        shape = self.node("Concat", [self.node("Shape", [scores], "scores_lead", end=3), self.ints(1)], "sinks_shape",
                          axis=0)
        return self.node("Expand", [column, shape], "sinks_column")

    def _group_query_attention(self, op: Op, q: str, cache_k: str, cache_v: str, sinks: str | None = None) -> str:
        """com.microsoft GroupQueryAttention: appends the new keys and values to each bound cache row at its
        length (its positions[0]) in place, and attends over the valid length only. Its softcap bends the
        scaled scores before the softmax, as the Program's does; its local_window_size W, in ONNX Runtime
        1.32's CPU kernel, is the Program's window: W keys, the query's own included (older sources kept
        W + 1; tests/backends/onnx pins it). Sinks are its head_sink input (its twelfth)."""
        spec = self.spec
        attrs: dict[str, Any] = {"scale": op.attrs["scale"]}
        if "softcap" in op.attrs:
            attrs["softcap"] = op.attrs["softcap"]
        if "window" in op.attrs:
            attrs["local_window_size"] = op.attrs["window"]
        (past_k, k), (past_v, v) = self._appended.pop(cache_k), self._appended.pop(cache_v)
        seqlens, total = self._gqa_lengths()
        qkv = [self.flat(q), k, v]
        rotary: dict[str, Any] = {}
        packed = self._packed_rotary(*qkv)
        tables: list[str] = []
        if packed:  # the kernel splits q/k/v and rotates q and k itself, by the tables their rotations read
            qkv, tables, rotary = [packed[0], "", ""], list(packed[1:]), {"do_rotary": 1, "rotary_interleaved": 0}
        out = self.fresh("attn")
        if sinks is not None:  # after the tables (or none), position_ids and attention_bias (none)
            tables = [*(tables or ["", ""]), "", "", sinks]
        self.nodes.append(helper.make_node(
            "GroupQueryAttention", [*qkv, past_k, past_v, seqlens, total, *tables],
            [out, cache_k, cache_v], name=out, domain="com.microsoft", num_heads=spec.num_heads,
            kv_num_heads=spec.num_kv_heads, **attrs, **rotary))
        return self.rounded(out)

    def _packed_rotary(self, q: str, k: str, v: str) -> tuple[str, str, str] | None:
        """The fused q/k/v product, where q and k are only its parts rotated at ``positions`` by one pair
        of tables and v its last part (no q/k norm, nothing else reads them): the Split and both rotations
        are taken out; the product and the tables. The kernel rotates whole heads: with partial rotary, q
        and k are concatenations, and nothing matches."""
        made = {out: node for node in self.nodes for out in node.output}
        rot_q, rot_k, split = made.get(q), made.get(k), made.get(v)
        if not (rot_q and rot_k and split and split.op_type == "Split" and self.compute == self.act
                and all(r.op_type == "RotaryEmbedding" and r.input[1] == "positions" for r in (rot_q, rot_k))
                and rot_q.input[2:] == rot_k.input[2:]
                and [rot_q.input[0], rot_k.input[0], v] == list(split.output)):
            return None
        taken = (rot_q, rot_k, split)
        if any(i in (*rot_q.output, *rot_k.output, *split.output[:2]) for n in self.nodes if n not in taken
               for i in n.input):
            return None
        self.nodes = [n for n in self.nodes if n not in taken]
        return split.input[0], rot_q.input[2], rot_q.input[3]

    # -- the mixture of experts --------------------------------------------------------------------
    def op_moe(self, op: Op, x: str, router: str, gate: str, up: str, down: str, *biases: str) -> str:
        """The Program's ``moe``, sparse: ONNX Runtime's com.microsoft MoE kernel (ort), which runs each
        expert on the tokens that chose it; or a Loop over the experts the step's tokens chose (plain)."""
        attrs = op.attrs
        logits = self.op_linear(op, x, router, *biases[:1] if attrs.get("router_bias") else ())
        expert_biases = biases[-3:] if attrs.get("expert_bias") else (None, None, None)
        if self.contrib:
            return self._moe_kernel(op, x, logits, down, expert_biases[2])
        return self._moe_loop(op, x, logits, (gate, up, down), expert_biases)

    def _moe_kernel(self, op: Op, x: str, logits: str, down: str, down_bias: str | None) -> str:
        """com.microsoft MoE: a softmax over the router's logits, each token's top k, their weights
        renormalised where asked (a softmax over the top k logits is the renormalised top k of the one over
        all), gate and up interleaved in one matrix (``INTERLEAVED``: the one layout its CPU kernel takes),
        the activation g' sigmoid(alpha g') (u' + beta), g' and u' clamped at the limit where there is one."""
        attrs = op.attrs
        clamped = attrs["activation"] == "clamped_swiglu"
        renormalise = attrs["gating"] == "topk_softmax" or attrs.get("normalize", False)
        options: dict[str, Any] = {"k": attrs["top_k"], "activation_type": "swiglu", "swiglu_fusion": 1,
                                   "normalize_routing_weights": int(renormalise),
                                   "activation_alpha": attrs.get("alpha", 1.0), "activation_beta": float(clamped)}
        if clamped:
            options["swiglu_limit"] = attrs["limit"]
        gate_up = self.weight("expert_gate_up")
        gate_up_bias = self.weight("expert_gate_up_bias") if down_bias else ""
        experts = int(self.types[op.inputs[1]].shape[0])
        router_logits = self.node("Reshape", [logits, self.ints(-1, experts)], "router_logits")
        y = self.node("MoE", [x, router_logits, gate_up, gate_up_bias, down, down_bias or ""], "moe",
                      domain="com.microsoft", **options)
        return self.rounded(y)

    def _moe_loop(self, op: Op, x: str, logits: str, stacks: tuple[str, str, str],
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

    def _scatter_index(self, at: str = "positions") -> str:
        """[R, T, KV, 3] indices (rows[r], head, at[r, t]) into a [ROWS, KV, P, D] cache: at the positions,
        or a ring's slots."""
        def build() -> str:
            kv = self.spec.num_kv_heads
            shape = self.node("Concat", [self.node("Shape", ["positions"], "rt"), self.ints(kv, 1)], "rtk1", axis=0)
            rows = self.node("Reshape", ["rows", self.ints(-1, 1, 1, 1)], "rows_b")
            heads = self.const("kv_heads", np.arange(kv, dtype=np.int64).reshape(1, 1, kv, 1))
            positions = self.node("Unsqueeze", [at, self.ints(2, 3)], "pos_b")
            parts = [self.node("Expand", [p, shape], "index_part") for p in (rows, heads, positions)]
            return self.node("Concat", parts, "scatter_index", axis=-1)
        return self._once("scatter_index" if at == "positions" else f"scatter_index:{at}", build)

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

    def _gqa_lengths(self) -> tuple[str, str]:
        """GroupQueryAttention's lengths: per row its last position ([R] int32, "seqlens_k") and the
        longest row's length (an int32 scalar)."""
        def build() -> tuple[str, str]:
            last = self.node("ReduceMax", ["positions", self.ints(1)], "last_pos", keepdims=0)
            longest = self.node("Add", [self.node("ReduceMax", [last], "max_pos", keepdims=0), self._one()], "total")
            return self.cast(last, "i32", "seqlens_k"), self.cast(longest, "i32", "total_len")
        return self._once("gqa_lengths", build)

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


def build_graph(program: Program, weight_shapes: Mapping[str, tuple[int, ...]], rope_positions: int,
                options: GraphOptions = GraphOptions()) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The step as a ModelProto whose weights are declared but not filled (``attach_weights`` does).

    ``weight_shapes`` are the weight plan's arrays' shapes by name; rope tables cover ``rope_positions``.
    Returns the model and, per initializer name of a weight, the weight plan's name.
    """
    program = lower(program, NATIVE_OPS)
    typed = infer_types(program)  # each section's values
    spec = program.spec
    e = _Emitter(program, options)
    weights: dict[str, str] = {}  # initializer name -> plan name
    stored = program.dtype  # weights are stored in the run dtype, cast once where compute is wider

    blocks = block_names(program.quantized, spec.num_layers)
    if blocks and not e.contrib:
        raise ValueError("matrices in blocks run on ONNX Runtime's contrib operators: they need the ort variant")
    part_types = {"codes": TensorProto.UINT8, "zero_points": TensorProto.UINT8,
                  "scales": ONNX_TYPES[e.compute], "mins": ONNX_TYPES[e.compute]}
    types: dict[str, int] = {}  # an initializer's type where it is not the weights' dtype

    def weight(plan_name: str) -> str:
        def declare() -> str:
            name = "w." + plan_name
            e._names.add(name)
            if plan_name in blocks:  # its parts are the initializers; ``name`` only keys ``e.blocks``
                parts = {p: f"{name}.{p}" for p in PARTS if f"{plan_name}.{p}" in weight_shapes}
                for part, initializer in parts.items():
                    weights[initializer], types[initializer] = f"{plan_name}.{part}", part_types[part]
                    e._names.add(initializer)
                n, nb = weight_shapes[f"{plan_name}.scales"]
                k = nb * block_size(blocks[plan_name])
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

    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, shape) for n, shape in
              (("tokens", ["R", "T"]), ("positions", ["R", "T"]), ("rows", ["R"]), ("select", ["R", "S"]))]
    cache_type = ONNX_TYPES[e.compute]
    cache_shape: list[str | int] = ["ROWS", spec.num_kv_heads, "P", spec.head_dim]
    ring_shape: list[str | int] = ["ROWS", spec.num_kv_heads, "SLOTS", spec.head_dim]  # a ring's slots, any number
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["R", "S", spec.vocab_size]),
               helper.make_tensor_value_info("next_ids", TensorProto.INT64, ["R", "S"])]
    e._names.update(("tokens", "positions", "rows", "select", "logits", "next_ids"))
    rope = _rope_initializers(program, rope_positions, e)

    env = {n: n for n in ("tokens", "positions", "rows", "select", "rope_cos", "rope_sin")}
    e.emit_section(program.embed, typed["embed"], env, weight)
    x = env[program.embed.results[0]]
    rings = [program.ring(kind) for kind in program.layer_kinds]
    e.full_cache = f"cache_k.{next((i for i, ring in enumerate(rings) if ring is None), 0)}"
    for i in range(spec.num_layers):
        names = {kind: f"cache_{kind}.{i}" for kind in "kv"}
        shape = cache_shape if rings[i] is None else ring_shape
        for kind in "kv":
            e._names.add(names[kind])
            inputs.append(helper.make_tensor_value_info(names[kind], cache_type, shape))
            outputs.append(helper.make_tensor_value_info(f"{names[kind]}.out", cache_type, shape))
        layer_env = {**env, "x": x, "cache_k": names["k"], "cache_v": names["v"]}
        section = program.layer_section(i)
        e.emit_section(section, typed[layer_section_name(program, program.layer_kinds[i])], layer_env,
                       lambda n, i=i: weight(f"layers.{i}.{n}"))
        x = layer_env[section.results[0]]
    head_weights = (lambda n: weight("embed" if n == "lm_head" else n)) if spec.tie_word_embeddings else weight
    head_env = {**env, "x": x}
    e.lead_source = "select"
    e.emit_section(program.head, typed["head"], head_env, head_weights)
    last = e.nodes[-1]  # the head's last node makes the logits: it names them as the graph's output (no copy)
    assert last.output[0] == head_env[program.head.results[0]]
    last.output[0] = "logits"
    e.nodes.append(helper.make_node("ArgMax", ["logits"], ["next_ids"], axis=-1, keepdims=0))

    nodes = _live(e.nodes, {o.name for o in outputs})
    read = {name for node in nodes for name in _reads(node)}
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
            needed.update(_reads(node))
    return kept[::-1]


def _reads(node: onnx.NodeProto) -> set[str]:
    """The names a node reads: its inputs, and those its subgraphs' nodes read (a Loop's body)."""
    names = set(node.input)
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            names.update(name for inner in attribute.g.node for name in _reads(inner))
    return names


def _declared(name: str, data_type: int, shape: tuple[int, ...]) -> onnx.TensorProto:
    """A weight's initializer, its data to be attached as external data."""
    tensor = onnx.TensorProto(name=name, data_type=data_type, dims=shape)
    tensor.data_location = TensorProto.EXTERNAL
    return tensor


def _rope_initializers(program: Program, positions: int, e: _Emitter) -> list[onnx.TensorProto]:
    """The rotary tables: the Program's f32 [positions, ROTARY_DIM] tables (plain), or the half tables in
    the compute dtype, rounded to the run dtype, that com.microsoft RotaryEmbedding takes (ort)."""
    from linnet.rope import rope_tables

    cos, sin = rope_tables(program.spec, positions)
    if not e.contrib:
        e._names.update({"rope_cos", "rope_sin"})
        return [onnx.numpy_helper.from_array(cos, "rope_cos"), onnx.numpy_helper.from_array(sin, "rope_sin")]
    width, tables = program.spec.rotary_dim, []
    for index in range(program.spec.rope_table_count):  # each table's first half, its own initializer
        for name, table in (("cos", cos), ("sin", sin)):
            half = _half_name(name, index)
            columns = table[:, index * width:index * width + width // 2]
            rounded = columns.astype(DTYPES[program.dtype].numpy).astype(DTYPES[e.compute].numpy)
            tables.append(onnx.numpy_helper.from_array(np.ascontiguousarray(rounded), f"rope_{half}"))
            e._shared[half] = f"rope_{half}"
            e._names.add(f"rope_{half}")
    return tables


def _half_name(name: str, table: int) -> str:
    """The half table (ort) of rotary table ``table``: ``cos_half``, ``cos_half.1``, ..."""
    return f"{name}_half" + (f".{table}" if table else "")
