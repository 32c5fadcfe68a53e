"""Lower a Linnet program to StableHLO MLIR text, op by op, for fixed sizes: no JAX tracing involved.

One module is one step of fixed shape (decode: every cache row, one token; prefill: one row, a padded
chunk), its entry point ``main``. The calling convention (``arguments``) is the Program's step with the
layers unrolled: ``tokens, positions, rows, select`` (i32), each layer's ``cache_k.<i>`` then each
``cache_v.<i>`` [ROWS, KV_HEADS, P, HEAD_DIM], ``rope_cos, rope_sin`` [P, ROTARY_DIM * TABLES] f32, then
the weights by name in the program's layout (``linnet.weight_plan``); results: logits [R, S, VOCAB] f32
and the caches in argument order, each cache result aliasing its argument (the caller donates the caches
and XLA writes them in place). Every op carries its source location: the section, layer and Program op it
lowers, and its own value's name, which XLA's errors name. Each layer is its kind's section
(``Program.layer_section``), inlined.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from linnet.errors import LinnetError
from linnet.program import Op, Program, infer_types, layer_section_name, lower

# The ops written as StableHLO; any other composite (layer_norm) reaches the emitter as its decomposition.
NATIVE_OPS = frozenset({
    "embedding", "linear", "split", "concat", "split_heads", "cache_write", "select", "cast", "add", "sub", "mul",
    "scale", "shift", "tanh", "rsqrt", "mean", "activation",  # primitives
    "rms_norm", "rotary", "attention", "rms_linear",  # kernels
    "swiglu", "softcap", "norm_linear",  # composites with a form shorter than their decompositions
    "moe",  # a kernel with no decomposition (``op_moe``)
})
_ATTENTION_ATTRS = {"scale", "softcap", "window", "ring", "sinks"}

_TYPES = {"f32": "f32", "f16": "f16", "bf16": "bf16", "i32": "i32", "i1": "i1"}


@dataclass(frozen=True)
class V:
    """An SSA value: its name, shape and element type."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def type(self) -> str:
        return tensor_type(self.shape, self.dtype)


def tensor_type(shape: tuple[int, ...], dtype: str) -> str:
    return f"tensor<{''.join(f'{n}x' for n in shape)}{_TYPES[dtype]}>"


@dataclass(frozen=True)
class Sizes:
    R: int
    T: int
    S: int
    ROWS: int
    P: int


def arguments(program: Program, sizes: Sizes) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of each argument of ``main``, in order: the calling convention."""
    spec, act = program.spec, program.dtype
    rings = [program.ring(kind) for kind in program.layer_kinds]
    caches = [(sizes.ROWS, spec.num_kv_heads, sizes.P if ring is None else ring + 1, spec.head_dim) for ring in rings]
    args = [("tokens", (sizes.R, sizes.T), "i32"), ("positions", (sizes.R, sizes.T), "i32"),
            ("rows", (sizes.R,), "i32"), ("select", (sizes.R, sizes.S), "i32")]
    args += [(f"cache_k.{i}", cache, act) for i, cache in enumerate(caches)]
    args += [(f"cache_v.{i}", cache, act) for i, cache in enumerate(caches)]
    args += [(f"rope_{t}", (sizes.P, spec.rotary_dim * spec.rope_table_count), "f32") for t in ("cos", "sin")]
    return args + [(name, shape, act) for name, shape in weight_shapes(program)]


def weight_shapes(program: Program) -> list[tuple[str, tuple[int, ...]]]:
    """The weights ``main`` takes, by canonical name (``layers.<i>.qkv``), in argument order."""
    types = infer_types(program)
    top = sorted({n[2:] for s in ("embed", "head") for n in types[s] if n.startswith("w.")})
    if program.spec.tie_word_embeddings:
        top.remove("lm_head")  # the head reads the embedding

    def shape(section: str, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in types[section][f"w.{name}"].shape)  # weights have fixed sizes

    out = [(n, shape("head" if f"w.{n}" in types["head"] else "embed", n)) for n in top]
    for i, kind in enumerate(program.layer_kinds):
        section = layer_section_name(program, kind)
        names = sorted(n[2:] for n in types[section] if n.startswith("w."))
        out += [(f"layers.{i}.{n}", shape(section, n)) for n in names]
    return out


def emit_module(program: Program, sizes: Sizes, name: str) -> str:
    """The module ``name`` with entry point ``main``: one step of the program at ``sizes``."""
    return _Emitter(lower(program, NATIVE_OPS), sizes).module(name)


class _Emitter:
    def __init__(self, program: Program, sizes: Sizes):
        self.program, self.sizes, self.act = program, sizes, program.dtype
        self.lines: list[str] = []
        self.count = 0
        self.loc = "step"
        self.rope: tuple[V, V] | None = None
        self.rope_tables: dict[int, tuple[V, ...]] = {}  # each rotary table's columns of ``rope``
        self.shared: dict[tuple, V] = {}  # per-step values every layer of a ring reuses (its slots, its mask)

    # -- the module --------------------------------------------------------------------------------
    def module(self, name: str) -> str:
        program, spec = self.program, self.program.spec
        args = {n: V(f"%{n}", shape, dtype) for n, shape, dtype in arguments(program, self.sizes)}
        layers = spec.num_layers
        env = dict(args)
        (x,) = self.section("embed", program.embed, env, lambda w: args[w])
        caches_k, caches_v = [], []
        for i in range(layers):
            params = {"x": x, "cache_k": args[f"cache_k.{i}"], "cache_v": args[f"cache_v.{i}"]}
            x, k, v = self.section(f"layer {i}", program.layer_section(i), {**env, **params},
                                   lambda w, i=i: args[f"layers.{i}.{w}"])
            caches_k.append(k)
            caches_v.append(v)
        head_weight = (lambda w: args["embed" if w == "lm_head" else w]) if spec.tie_word_embeddings \
            else (lambda w: args[w])
        (logits,) = self.section("head", program.head, {**env, "x": x}, head_weight)
        results = [logits, *caches_k, *caches_v]
        first_cache = 4  # the caches follow tokens, positions, rows, select
        signature = ", ".join(
            f"{a.name}: {a.type}" + (f" {{tf.aliasing_output = {i - first_cache + 1} : i32}}"
                                     if first_cache <= i < first_cache + 2 * layers else "")
            for i, a in enumerate(args.values()))
        body = "\n".join(f"    {line}" for line in self.lines)
        return (
            f"module @{name} attributes {{mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32}} {{\n"
            f"  func.func public @main({signature}) -> ({', '.join(r.type for r in results)}) {{\n"
            f"{body}\n"
            f"    return {', '.join(r.name for r in results)} : {', '.join(r.type for r in results)}\n"
            f"  }}\n}}\n"
        )

    def section(self, where: str, section, env: dict, weight) -> list[V]:
        for op in section.ops:
            self.loc = f"{where}: {', '.join(op.outs)} = {op.kind}"
            args = [weight(i[2:]) if i.startswith("w.") else env[i] for i in op.inputs]
            outs = getattr(self, f"op_{op.kind}")(op, *args)
            env.update(zip(op.outs, outs if isinstance(outs, list) else [outs]))
        return [env[r] for r in section.results]

    # -- one line each ---------------------------------------------------------------------------------
    def emit(self, text: str, shape: tuple[int, ...], dtype: str) -> V:
        self.count += 1
        value = V(f"%v{self.count}", tuple(shape), dtype)
        self.lines.append(f'{value.name} = {text} loc("{self.loc} ({value.name})")')
        return value

    def const(self, value: float | int, dtype: str, shape: tuple[int, ...] = ()) -> V:
        if dtype == "i32":
            literal = str(int(value))
        else:  # MLIR float literals need a decimal point; -inf is spelled as its bits
            literal = "0xFF800000" if value == float("-inf") else f"{float(value):.17e}"
        scalar = self.emit(f"stablehlo.constant dense<{literal}> : {tensor_type((), dtype)}", (), dtype)
        return self.broadcast(scalar, shape, []) if shape else scalar

    def broadcast(self, x: V, shape: tuple[int, ...], dims: list[int]) -> V:
        if x.shape == tuple(shape):
            return x
        out_type = tensor_type(shape, x.dtype)
        return self.emit(f"stablehlo.broadcast_in_dim {x.name}, dims = {list(dims)} : ({x.type}) -> {out_type}",
                         shape, x.dtype)

    def trailing(self, x: V, shape: tuple[int, ...]) -> V:
        """x broadcast along leading axes to shape (x's axes are shape's last ones)."""
        return self.broadcast(x, shape, list(range(len(shape) - len(x.shape), len(shape))))

    def leading(self, x: V, shape: tuple[int, ...]) -> V:
        """x broadcast along trailing axes to shape (x's axes are shape's first ones)."""
        return self.broadcast(x, shape, list(range(len(x.shape))))

    def binary(self, kind: str, a: V, b: V) -> V:
        return self.emit(f"stablehlo.{kind} {a.name}, {b.name} : {a.type}", a.shape, a.dtype)

    def unary(self, kind: str, a: V) -> V:
        return self.emit(f"stablehlo.{kind} {a.name} : {a.type}", a.shape, a.dtype)

    def compare(self, direction: str, a: V, b: V, kind: str) -> V:
        """a DIRECTION b elementwise (``kind``: SIGNED, FLOAT), as i1."""
        return self.emit(f"stablehlo.compare {direction}, {a.name}, {b.name}, {kind} : ({a.type}, {b.type}) -> "
                         f"{tensor_type(a.shape, 'i1')}", a.shape, "i1")

    def convert(self, x: V, dtype: str) -> V:
        if x.dtype == dtype:
            return x
        return self.emit(f"stablehlo.convert {x.name} : ({x.type}) -> {tensor_type(x.shape, dtype)}", x.shape, dtype)

    def reshape(self, x: V, shape: tuple[int, ...]) -> V:
        return self.emit(f"stablehlo.reshape {x.name} : ({x.type}) -> {tensor_type(shape, x.dtype)}", shape, x.dtype)

    def reduce(self, kind: str, x: V, init: float) -> V:
        """Over the last axis."""
        start = self.const(init, x.dtype)
        shape = x.shape[:-1]
        return self.emit(f"stablehlo.reduce({x.name} init: {start.name}) applies stablehlo.{kind} across dimensions = "
                         f"[{len(x.shape) - 1}] : ({x.type}, {start.type}) -> {tensor_type(shape, x.dtype)}",
                         shape, x.dtype)

    def slice_last(self, x: V, start: int, stop: int) -> V:
        bounds = ", ".join([f"0:{n}" for n in x.shape[:-1]] + [f"{start}:{stop}"])
        shape = (*x.shape[:-1], stop - start)
        return self.emit(f"stablehlo.slice {x.name} [{bounds}] : ({x.type}) -> {tensor_type(shape, x.dtype)}",
                         shape, x.dtype)

    def concat_last(self, parts: list[V]) -> V:
        shape = (*parts[0].shape[:-1], sum(p.shape[-1] for p in parts))
        return self.emit(f"stablehlo.concatenate {', '.join(p.name for p in parts)}, dim = {len(shape) - 1} : "
                         f"({', '.join(p.type for p in parts)}) -> {tensor_type(shape, parts[0].dtype)}",
                         shape, parts[0].dtype)

    def dot(self, a: V, b: V, batch: tuple[list[int], list[int]], contract: tuple[list[int], list[int]],
            shape: tuple[int, ...], dtype: str) -> V:
        batching = f"batching_dims = {batch[0]} x {batch[1]}, " if batch[0] else ""
        return self.emit(f"stablehlo.dot_general {a.name}, {b.name}, {batching}contracting_dims = {contract[0]} x "
                         f"{contract[1]} : ({a.type}, {b.type}) -> {tensor_type(shape, dtype)}", shape, dtype)

    def gather_rows(self, table: V, indices: V) -> V:
        """table[indices] along the first axis: [*indices.shape, *table.shape[1:]]."""
        n = len(indices.shape)
        index = self.reshape(indices, (*indices.shape, 1))
        shape = (*indices.shape, *table.shape[1:])
        offsets = list(range(n, len(shape)))
        slice_sizes = ", ".join(map(str, (1, *table.shape[1:])))
        return self.emit(
            f'"stablehlo.gather"({table.name}, {index.name}) <{{dimension_numbers = #stablehlo.gather<offset_dims = '
            f"{offsets}, collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = {n}>, "
            f"indices_are_sorted = false, slice_sizes = array<i64: {slice_sizes}>}}> : ({table.type}, {index.type}) "
            f"-> {tensor_type(shape, table.dtype)}", shape, table.dtype)

    # -- the Program's ops, as linnet.program defines them ------------------------------------------------
    def rms_scale(self, x: V, eps: float) -> V:
        x32 = self.convert(x, "f32")
        total = self.reduce("add", self.binary("multiply", x32, x32), 0.0)
        mean = self.binary("divide", total, self.const(x.shape[-1], "f32", total.shape))
        scale = self.unary("rsqrt", self.binary("add", mean, self.const(eps, "f32", total.shape)))
        return self.leading(scale, x.shape)

    def op_rms_norm(self, op: Op, x: V, w: V) -> V:
        scaled = self.binary("multiply", self.convert(x, "f32"), self.rms_scale(x, op.attrs["eps"]))
        normed = self.convert(scaled, x.dtype)
        return self.binary("multiply", self.trailing(w, x.shape), normed)

    def op_linear(self, op: Op, x: V, w: V, b: V | None = None) -> V:
        shape = (*x.shape[:-1], w.shape[0])
        y = self.dot(x, w, ([], []), ([len(x.shape) - 1], [1]), shape, x.dtype)
        return y if b is None else self.binary("add", y, self.trailing(b, shape))

    def op_norm_linear(self, op: Op, x: V, n: V, w: V, b: V | None = None) -> V:
        return self.op_linear(op, self.op_rms_norm(op, x, n), w, b)

    def op_rms_linear(self, op: Op, x: V, w: V, *rest: V) -> V:
        scale = self.rms_scale(x, op.attrs["eps"])
        bias = rest[:-1] if op.attrs.get("norm") else rest
        if op.attrs.get("norm"):
            x = self.binary("multiply", self.trailing(rest[-1], x.shape), x)
        scaled = self.convert(self.binary("multiply", self.convert(x, "f32"), scale), x.dtype)
        return self.op_linear(op, scaled, w, *bias)

    def op_split(self, op: Op, x: V) -> list[V]:
        out, at = [], 0
        for size in op.attrs["sizes"]:
            out.append(self.slice_last(x, at, at + size))
            at += size
        return out

    def op_split_heads(self, op: Op, x: V) -> V:
        heads = op.attrs["heads"]
        return self.reshape(x, (*x.shape[:-1], heads, x.shape[-1] // heads))

    def op_rotary(self, op: Op, x: V, positions: V, cos: V, sin: V) -> V:
        unknown = sorted(set(op.attrs) - {"table"})
        if unknown:
            raise LinnetError(f"the xla:stablehlo backend has no rotary attribute {', '.join(unknown)} (op {op})")
        if self.rope is None:  # gathered once per step, for every layer
            rope_cos, rope_sin = (self.convert(self.gather_rows(t, positions), self.act) for t in (cos, sin))
            self.rope = (rope_cos, rope_sin)
        width, table = x.shape[-1], op.attrs.get("table", 0)
        if table not in self.rope_tables:  # table j's columns of the tables side by side, cut once per step
            self.rope_tables[table] = self.rope if self.rope[0].shape[-1] == width else tuple(
                self.slice_last(t, table * width, (table + 1) * width) for t in self.rope)
        c, s = (self.broadcast(t, x.shape, [0, 1, 3]) for t in self.rope_tables[table])
        half = x.shape[-1] // 2
        rotated = self.concat_last([self.unary("negate", self.slice_last(x, half, x.shape[-1])),
                                    self.slice_last(x, 0, half)])
        return self.binary("add", self.binary("multiply", x, c), self.binary("multiply", rotated, s))

    def op_cache_write(self, op: Op, cache: V, rows: V, positions: V, value: V) -> V:
        if "ring" in op.attrs:
            positions = self.ring_slots(positions, op.attrs["ring"], op.attrs["scratch"])
        r, t = positions.shape
        row = self.broadcast(rows, (r, t, 1), [0])
        indices = self.concat_last([row, self.reshape(positions, (r, t, 1))])
        return self.emit(
            f'"stablehlo.scatter"({cache.name}, {indices.name}, {value.name}) <{{indices_are_sorted = false, '
            f"scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [2, 3], "
            f"inserted_window_dims = [0, 2], "
            f"scatter_dims_to_operand_dims = [0, 2], index_vector_dim = 2>, unique_indices = false}}> ({{\n"
            f"    ^bb0(%old{self.count}: {tensor_type((), cache.dtype)}, "
            f"%new{self.count}: {tensor_type((), cache.dtype)}):\n"
            f"      stablehlo.return %new{self.count} : {tensor_type((), cache.dtype)}\n"
            f"    }}) : ({cache.type}, {indices.type}, {value.type}) -> {cache.type}", cache.shape, cache.dtype)

    def op_attention(self, op: Op, q: V, cache_k: V, cache_v: V, rows: V, positions: V, sinks: V | None = None) -> V:
        unknown = sorted(set(op.attrs) - _ATTENTION_ATTRS)
        if unknown:
            raise LinnetError(f"the xla:stablehlo backend has no attention attribute {', '.join(unknown)} (op {op})")
        r, t, heads, d = q.shape
        kv, p = cache_k.shape[1], cache_k.shape[2]
        g = heads // kv
        keys = self.convert(self.gather_rows(cache_k, rows), "f32")  # [R, KV, P, D]
        values = self.convert(self.gather_rows(cache_v, rows), "f32")
        grouped = self.convert(self.reshape(q, (r, t, kv, g, d)), "f32")
        shape = (r, kv, t, g, p)
        scores = self.dot(grouped, keys, ([0, 2], [0, 1]), ([4], [3]), shape, "f32")
        scores = self.binary("multiply", scores, self.const(op.attrs["scale"], "f32", shape))
        if "softcap" in op.attrs:
            scores = self.softcap(scores, op.attrs["softcap"])
        key_positions = self.emit(f"stablehlo.iota dim = 0 : {tensor_type((p,), 'i32')}", (p,), "i32")
        key_positions = self.broadcast(key_positions, shape, [4])
        query_positions = self.broadcast(positions, shape, [0, 2])
        if "ring" in op.attrs:
            visible = self.ring_visible(key_positions, query_positions, op.attrs["ring"], op.attrs["window"])
        else:
            visible = self.compare("LE", key_positions, query_positions, "SIGNED")
        if "window" in op.attrs and "ring" not in op.attrs:  # and p > t - window
            oldest = self.binary("subtract", query_positions, self.const(op.attrs["window"], "i32", shape))
            visible = self.binary("and", visible, self.compare("GT", key_positions, oldest, "SIGNED"))
        masked = self.emit(f"stablehlo.select {visible.name}, {scores.name}, "
                           f"{self.const(float('-inf'), 'f32', shape).name} : {visible.type}, {scores.type}",
                           shape, "f32")
        if sinks is not None:  # each head's sink: one more logit, a column that weighs no value
            sink = self.broadcast(self.convert(self.reshape(sinks, (kv, g)), "f32"), (r, kv, t, g, 1), [1, 3])
            masked = self.concat_last([masked, sink])
        weights = self.softmax(masked)
        if sinks is not None:
            weights = self.slice_last(weights, 0, p)
        out = self.dot(weights, values, ([0, 1], [0, 1]), ([4], [2]), (r, kv, t, g, d), "f32")
        out = self.emit(f"stablehlo.transpose {out.name}, dims = [0, 2, 1, 3, 4] : ({out.type}) -> "
                        f"{tensor_type((r, t, kv, g, d), 'f32')}", (r, t, kv, g, d), "f32")
        return self.reshape(self.convert(out, self.act), (r, t, heads * d))

    def softmax(self, x: V) -> V:
        """Over the last axis."""
        peak = self.leading(self.reduce("maximum", x, float("-inf")), x.shape)
        weights = self.unary("exponential", self.binary("subtract", x, peak))
        return self.binary("divide", weights, self.leading(self.reduce("add", weights, 0.0), x.shape))

    def ring_slots(self, positions: V, ring: int, scratch: int) -> V:
        """Where each position is written in a ring cache: p mod ring, the scratch position at slot ring."""
        def build() -> V:
            shape = positions.shape
            wrapped = self.binary("remainder", positions, self.const(ring, "i32", shape))
            scratched = self.compare("EQ", positions, self.const(scratch, "i32", shape), "SIGNED")
            last = self.const(ring, "i32", shape)
            return self.emit(f"stablehlo.select {scratched.name}, {last.name}, {wrapped.name} : {scratched.type}, "
                             f"{wrapped.type}", shape, "i32")
        return self._once(("slots", ring, scratch), build)

    def ring_visible(self, slots: V, queries: V, ring: int, window: int) -> V:
        """Which slots of a ring the queries see: slot s < ring holds the key age = (q - s) mod ring back,
        seen where age < window and age <= q (q - s + ring is never negative: remainder's sign is moot)."""
        def build() -> V:
            shape = slots.shape
            size = self.const(ring, "i32", shape)
            age = self.binary("remainder", self.binary("add", self.binary("subtract", queries, slots), size), size)
            visible = self.compare("LT", slots, size, "SIGNED")
            visible = self.binary("and", visible, self.compare("LT", age, self.const(window, "i32", shape), "SIGNED"))
            return self.binary("and", visible, self.compare("LE", age, queries, "SIGNED"))
        return self._once(("visible", ring, window, slots.shape), build)

    def _once(self, key: tuple, build) -> V:
        if key not in self.shared:
            self.shared[key] = build()
        return self.shared[key]

    def op_swiglu(self, op: Op, gate: V, up: V) -> V:
        return self.binary("multiply", self.binary("multiply", gate, self.unary("logistic", gate)), up)

    def op_add(self, op: Op, a: V, b: V) -> V:
        return self.binary("add", a, self.trailing(b, a.shape))

    def op_sub(self, op: Op, a: V, b: V) -> V:
        return self.binary("subtract", a, self.trailing(b, a.shape))

    def op_mul(self, op: Op, a: V, b: V) -> V:
        return self.binary("multiply", a, self.trailing(b, a.shape))

    def op_scale(self, op: Op, x: V) -> V:
        return self.binary("multiply", x, self.const(op.attrs["factor"], x.dtype, x.shape))

    def op_shift(self, op: Op, x: V) -> V:
        return self.binary("add", x, self.const(op.attrs["amount"], x.dtype, x.shape))

    def op_tanh(self, op: Op, x: V) -> V:
        return self.unary("tanh", x)

    def op_rsqrt(self, op: Op, x: V) -> V:
        return self.unary("rsqrt", x)

    def op_mean(self, op: Op, x: V) -> V:
        total = self.reduce("add", x, 0.0)
        mean = self.binary("divide", total, self.const(x.shape[-1], x.dtype, total.shape))
        return self.reshape(mean, (*x.shape[:-1], 1))

    def op_concat(self, op: Op, *parts: V) -> V:
        return self.concat_last(list(parts))

    def softcap(self, x: V, cap: float) -> V:
        c = self.const(cap, x.dtype, x.shape)
        return self.binary("multiply", c, self.unary("tanh", self.binary("divide", x, c)))

    def op_softcap(self, op: Op, x: V) -> V:
        return self.softcap(x, op.attrs["cap"])

    def op_activation(self, op: Op, x: V) -> V:
        fn = op.attrs["fn"]
        if fn == "silu":
            return self.binary("multiply", x, self.unary("logistic", x))
        half_x = self.binary("multiply", self.const(0.5, x.dtype, x.shape), x)
        if fn == "gelu":  # x * Phi(x) = x / 2 * (1 + erf(x / sqrt 2)); erf is CHLO's, which XLA expands
            inner = self.binary("divide", x, self.const(math.sqrt(2.0), x.dtype, x.shape))
            bent = self.emit(f"chlo.erf {inner.name} : {inner.type} -> {inner.type}", x.shape, x.dtype)
        elif fn == "gelu_tanh":
            cube = self.binary("multiply", self.binary("multiply", x, x), x)
            inner = self.binary("add", x, self.binary("multiply", self.const(0.044715, x.dtype, x.shape), cube))
            scaled = self.binary("multiply", self.const(math.sqrt(2 / math.pi), x.dtype, x.shape), inner)
            bent = self.unary("tanh", scaled)
        else:
            raise LinnetError(f"the xla:stablehlo backend has no activation {fn!r} (op {op})")
        return self.binary("multiply", half_x, self.binary("add", self.const(1.0, x.dtype, x.shape), bent))

    def op_embedding(self, op: Op, tokens: V, table: V) -> V:
        return self.gather_rows(table, tokens)

    def op_select(self, op: Op, x: V, select: V) -> V:
        r, s = select.shape
        entry = self.emit(f"stablehlo.iota dim = 0 : {tensor_type((r, s, 1), 'i32')}", (r, s, 1), "i32")
        indices = self.concat_last([entry, self.reshape(select, (r, s, 1))])
        shape = (r, s, *x.shape[2:])
        sizes = ", ".join(map(str, (1, 1, *x.shape[2:])))
        return self.emit(
            f'"stablehlo.gather"({x.name}, {indices.name}) <{{dimension_numbers = #stablehlo.gather<offset_dims = '
            f"{list(range(2, len(shape)))}, collapsed_slice_dims = [0, 1], start_index_map = [0, 1], "
            f"index_vector_dim = 2>, indices_are_sorted = false, slice_sizes = array<i64: {sizes}>}}> : "
            f"({x.type}, {indices.type}) -> {tensor_type(shape, x.dtype)}", shape, x.dtype)

    def op_cast(self, op: Op, x: V) -> V:
        return self.convert(x, op.attrs["dtype"])

    # -- the mixture of experts: a loop over the experts the step's tokens chose ---------------------------
    def op_moe(self, op: Op, x: V, router: V, gate: V, up: V, down: V, *biases: V) -> V:
        """The Program's ``moe``, sparse: each token's top_k picks, sorted by expert; a loop visits the
        experts some token chose in ascending order, each slicing its own matrices out of the stacks once
        (the others are never read) and running them on its tokens a tile at a time, adding its output
        times each token's weight to the token's sum (a tile's places past the expert's tokens scatter out
        of bounds, which XLA skips)."""
        attrs = op.attrs
        experts, width = router.shape
        k = attrs["top_k"]
        tokens = self.reshape(x, (math.prod(x.shape[:-1]), width))
        n = tokens.shape[0]
        logits = self.op_linear(op, tokens, router, *biases[:1] if attrs.get("router_bias") else ())
        scores = self.convert(logits, "f32")
        if attrs["gating"] == "softmax_topk":
            scores = self.softmax(scores)
        top = self.top_k(scores, k)
        weights = self.softmax(top[0]) if attrs["gating"] == "topk_softmax" else top[0]
        if attrs.get("normalize"):
            weights = self.binary("divide", weights, self.leading(self.reduce("add", weights, 0.0), weights.shape))
        picks = n * k
        chosen = self.reshape(top[1], (picks,))  # the picks, token by token
        weights = self.reshape(self.convert(weights, self.act), (picks,))
        order = self.sort_by(chosen)  # the picks by expert, each expert's in token order
        ids = self.iota((experts,))
        grid = (experts, picks)
        by_expert = self.broadcast(chosen, grid, [1]), self.broadcast(ids, grid, [0])
        counts = self.count_true(self.compare("EQ", *by_expert, "SIGNED"))  # each expert's picks
        starts = self.count_true(self.compare("LT", *by_expert, "SIGNED"))  # where they start in `order`
        tile = -(-picks // experts)  # an expert's picks on average: at most twice the work of no tiles
        expert_biases = biases[-3:] if attrs.get("expert_bias") else (None, None, None)

        def linear(h: V, w: V, b: V | None) -> V:
            return self.op_linear(op, h, w, *([] if b is None else [b]))

        def next_expert(e: V) -> V:
            """The lowest expert above e that some token chose; ``experts`` when none is left."""
            later = self.binary("and", self.compare("GT", counts, self.const(0, "i32", (experts,)), "SIGNED"),
                                self.compare("GT", ids, self.broadcast(e, (experts,), []), "SIGNED"))
            return self.reduce("minimum", self.select(later, ids, self.const(experts, "i32", (experts,))), experts)

        def run_expert(state: list[V]) -> list[V]:
            e, out = state
            w_gate, w_up, w_down = (self.expert_slice(m, e) for m in (gate, up, down))
            b_gate, b_up, b_down = (None if b is None else self.expert_slice(b, e) for b in expert_biases)
            count, start = self.expert_slice(counts, e), self.expert_slice(starts, e)
            tiles = self.binary("divide", self.binary("add", count, self.const(tile - 1, "i32")),
                                self.const(tile, "i32"))  # ceil(count / tile)

            def run_tile(state: list[V]) -> list[V]:
                i, out = state
                first = self.binary("multiply", i, self.const(tile, "i32"))  # the tile's places among e's picks:
                at = self.binary("add", self.broadcast(first, (tile,), []), self.iota((tile,)))
                index = self.binary("minimum", self.binary("add", self.broadcast(start, (tile,), []), at),
                                    self.const(picks - 1, "i32", (tile,)))
                pick = self.gather_rows(order, index)
                token = self.select(self.compare("LT", at, self.broadcast(count, (tile,), []), "SIGNED"),
                                    self.binary("divide", pick, self.const(k, "i32", (tile,))),
                                    self.const(n, "i32", (tile,)))  # n: past the end, an update skipped
                h = self.gather_rows(tokens, self.binary("minimum", token, self.const(n - 1, "i32", (tile,))))
                a = self.expert_activation(attrs, linear(h, w_gate, b_gate), linear(h, w_up, b_up))
                y = linear(a, w_down, b_down)
                y = self.binary("multiply", y, self.leading(self.gather_rows(weights, pick), y.shape))
                return [self.binary("add", i, self.const(1, "i32")), self.scatter_add_rows(out, token, y)]

            _, out = self.while_loop([self.const(0, "i32"), out],
                                     lambda state: self.compare("LT", state[0], tiles, "SIGNED"), run_tile)
            return [next_expert(e), out]

        zeros = self.const(0.0, self.act, tokens.shape)
        _, out = self.while_loop([next_expert(self.const(-1, "i32")), zeros],
                                 lambda state: self.compare("LT", state[0], self.const(experts, "i32"), "SIGNED"),
                                 run_expert)
        return self.reshape(out, x.shape)

    def expert_activation(self, attrs: dict, g: V, u: V) -> V:
        """silu(g) * u ("swiglu"), or gpt-oss's clamped form: g' * sigmoid(alpha g') * (u' + 1), with g'
        clamped above at limit and u' to [-limit, limit] ("clamped_swiglu")."""
        if attrs["activation"] == "swiglu":
            return self.binary("multiply", self.binary("multiply", g, self.unary("logistic", g)), u)
        limit = self.const(attrs["limit"], g.dtype, g.shape)
        g = self.binary("minimum", g, limit)
        u = self.binary("maximum", self.binary("minimum", u, limit), self.unary("negate", limit))
        gated = self.binary("multiply", g, self.unary("logistic", self.binary(
            "multiply", g, self.const(attrs["alpha"], g.dtype, g.shape))))
        return self.binary("multiply", gated, self.binary("add", u, self.const(1.0, u.dtype, u.shape)))

    def iota(self, shape: tuple[int, ...]) -> V:
        return self.emit(f"stablehlo.iota dim = 0 : {tensor_type(shape, 'i32')}", shape, "i32")

    def select(self, which: V, a: V, b: V) -> V:
        return self.emit(f"stablehlo.select {which.name}, {a.name}, {b.name} : {which.type}, {a.type}", a.shape,
                         a.dtype)

    def count_true(self, x: V) -> V:
        """Over the last axis: how many are true."""
        return self.reduce("add", self.convert(x, "i32"), 0)

    def top_k(self, x: V, k: int) -> tuple[V, V]:
        """The k largest along the last axis, and their indices (equal values: the lower index first)."""
        shape = (*x.shape[:-1], k)
        self.count += 1
        name = f"%v{self.count}"
        self.lines.append(f'{name}:2 = chlo.top_k({x.name}, k = {k}) : {x.type} -> ({tensor_type(shape, x.dtype)}, '
                          f'{tensor_type(shape, "i32")}) loc("{self.loc} ({name})")')
        return V(f"{name}#0", shape, x.dtype), V(f"{name}#1", shape, "i32")

    def sort_by(self, keys: V) -> V:
        """The indices that sort 1-D ``keys`` ascending, in a stable sort (equal keys keep their order)."""
        index = self.iota(keys.shape)
        self.count += 1
        name, scalar = f"%v{self.count}", tensor_type((), keys.dtype)
        self.lines.append(
            f'{name}:2 = "stablehlo.sort"({keys.name}, {index.name}) <{{dimension = 0 : i64, is_stable = true}}> ({{\n'
            f"      ^bb0(%a{self.count}: {scalar}, %b{self.count}: {scalar}, %i{self.count}: {scalar}, "
            f"%j{self.count}: {scalar}):\n"
            f"        %lt{self.count} = stablehlo.compare LT, %a{self.count}, %b{self.count}, SIGNED : "
            f"({scalar}, {scalar}) -> tensor<i1>\n"
            f"        stablehlo.return %lt{self.count} : tensor<i1>\n"
            f"    }}) : ({keys.type}, {index.type}) -> ({keys.type}, {index.type}) loc(\"{self.loc} ({name})\")")
        return V(f"{name}#1", keys.shape, "i32")

    def expert_slice(self, stack: V, e: V) -> V:
        """stack[e]: expert e's part of a stack, read alone (a dynamic slice)."""
        zeros = f", {self.const(0, 'i32').name}" * (len(stack.shape) - 1)
        shape = (1, *stack.shape[1:])
        sliced = self.emit(f"stablehlo.dynamic_slice {stack.name}, {e.name}{zeros}, sizes = {list(shape)} : "
                           f"({stack.type}{', tensor<i32>' * len(stack.shape)}) -> {tensor_type(shape, stack.dtype)}",
                           shape, stack.dtype)
        return self.reshape(sliced, stack.shape[1:])

    def scatter_add_rows(self, out: V, rows: V, updates: V) -> V:
        """out with updates [B, ...] added at its rows [B] (rows out of bounds skipped)."""
        index = self.reshape(rows, (*rows.shape, 1))
        scalar = tensor_type((), out.dtype)
        return self.emit(
            f'"stablehlo.scatter"({out.name}, {index.name}, {updates.name}) <{{indices_are_sorted = false, '
            f"scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = {list(range(1, len(out.shape)))}, "
            f"inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, "
            f"unique_indices = false}}> ({{\n"
            f"      ^bb0(%old{self.count}: {scalar}, %new{self.count}: {scalar}):\n"
            f"        %sum{self.count} = stablehlo.add %old{self.count}, %new{self.count} : {scalar}\n"
            f"        stablehlo.return %sum{self.count} : {scalar}\n"
            f"    }}) : ({out.type}, {index.type}, {updates.type}) -> {out.type}", out.shape, out.dtype)

    def while_loop(self, state: list[V], cond: Callable[[list[V]], V],
                   body: Callable[[list[V]], list[V]]) -> list[V]:
        """A ``stablehlo.while`` over ``state``: ``cond`` and ``body`` build its regions from the loop's
        arguments (what they read from outside the loop, they capture)."""
        self.count += 1
        name = f"%w{self.count}"
        args = [V(f"{name}_{i}", s.shape, s.dtype) for i, s in enumerate(state)]
        outer, self.lines = self.lines, []
        test = cond(args)
        regions = [[*self.lines, f"stablehlo.return {test.name} : {test.type}"]]
        self.lines = []
        results = body(args)
        regions.append([*self.lines, f"stablehlo.return {', '.join(r.name for r in results)} : "
                                     f"{', '.join(r.type for r in results)}"])
        self.lines = outer
        cond_text, body_text = ("\n".join(f"  {line}" for line in "\n".join(region).splitlines()) for region in regions)
        initial = ", ".join(f"{a.name} = {s.name}" for a, s in zip(args, state))
        self.lines.append(
            f"{name}:{len(state)} = stablehlo.while({initial}) : {', '.join(s.type for s in state)}\n"
            f"  cond {{\n{cond_text}\n  }} do {{\n{body_text}\n  }} loc(\"{self.loc} ({name})\")")
        return [V(f"{name}#{i}", s.shape, s.dtype) for i, s in enumerate(state)]
