"""The Linnet program: one model step as a pure function over typed, single-assignment values.

A backend is written from this docstring alone; ``linnet compile MODEL --target program`` prints a
model's program, and ``linnet.backends.reference`` executes it op by op as defined here.

The step
--------
    step(tokens, positions, rows, select, cache_k, cache_v, rope_cos, rope_sin, weights)
        -> logits, cache_k', cache_v'

Symbolic sizes: ``R`` batch entries, ``T`` tokens per entry, ``S`` selected tokens per entry, ``ROWS``
cache rows, ``P`` cache positions. Inputs:

    tokens     [R, T]   i64  token ids
    positions  [R, T]   i64  each token's position in its cache row, < P
    rows       [R]      i64  the cache row each entry reads and writes; distinct
    select     [R, S]   i64  indices into T: the tokens whose logits the step returns
    cache_k, cache_v    [LAYERS, ROWS, KV_HEADS, P, HEAD_DIM]  the run dtype
    rope_cos, rope_sin  [P, HEAD_DIM]  f32, from ``linnet.rope.rope_tables`` (Llama 3 scaling included)
    weights    ``w.<name>``, canonical names (``linnet.names``), in the weight dtype: the run dtype, or a
               narrower one (16-bit weights with f32 arithmetic, for CPUs, whose products are bound by
               the bytes they read); an op widens a weight to ``act`` where it reads it. A matrix named
               in ``Program.quantized`` is block-quantised instead (``linnet.quantize``): ``q8_0``,
               ``q4_0`` or ``q4_1``, llama.cpp's blocks of 32 along its in-axis, each an f16 scale d (and
               for q4_1 an f16 min m) and 32 codes q: w = d * q (q8_0, q int8), d * (q - 8) (q4_0,
               q in 0..15), d * q + m (q4_1); or ``q4_k`` / ``q6_k``, super-blocks of 256 whose
               sub-blocks are the same affine codes (``linnet.quantize.affine``); an op reads it as
               those values, in ``act``. With
               ``Program.int8_activations``, a linear op on such a matrix first rounds x to int8 per
               block of its scales (32; q6_k 16) with scale max|x| / 127, to nearest, as llama.cpp
               does, and multiplies the codes by those values; a block's min (q4_1, q4_k) multiplies
               the block's sum of x as it is

and it computes

    x = embed(tokens)
    for i in range(LAYERS):  x, cache_k[i], cache_v[i] = layer(x, cache_k[i], cache_v[i]; w.layers.<i>.*)
    logits = head(x)                                     # [R, S, VOCAB] f32

``embed``, ``layer`` and ``head`` are ``Section``s: ops over named values, each value assigned once,
with its shape and dtype (``infer_types``). A section reads its parameters, the step's inputs, and
weights; inside ``layer``, ``w.q`` means ``layers.<i>.q``. A tied head's ``w.lm_head`` is ``w.embed``.

Ops (``act`` is the run dtype; ``x[..., F]`` means any leading axes):
  embedding(tokens, table)              table[tokens], in act                    [R, T, H]
  rms_norm(x, w; eps)                   w * cast_act(x32 * rsqrt(mean(x32^2, -1) + eps)), x32 = f32(x);
                                        over the last axis (per head for q/k norm)
  linear(x, w[, b])                     x @ w.T (+ b), w [out, in]                 act
  split(x; sizes) -> (a, b, ...)        x cut along its last axis
  split_heads(x; heads)                 [..., heads * HEAD_DIM] -> [..., heads, HEAD_DIM]
  rotary(x, positions, cos, sin)        x * c + rotate_half(x) * s, c = cast_act(cos[positions]) (same
                                        for s), rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
  cache_write(cache, rows, positions, v)  the cache with cache[rows[r], :, positions[r, t]] = v[r, t];
                                        when two entries write one place, which one lands is unspecified
  attention(q, cache_k, cache_v, rows, positions)
                                        for entry r, token t, head h: softmax over p <= positions[r, t] of
                                        q[r,t,h] . cache_k[rows[r], h // G, p] / sqrt(HEAD_DIM), in f32,
                                        weighting cache_v[rows[r], h // G, p]; G = HEADS / KV_HEADS; heads
                                        merged: [R, T, HEADS * HEAD_DIM] act. It reads the cache the step
                                        just wrote, so a token sees itself and the tokens before it.
  swiglu(gate, up)                      silu(gate) * up
  add(a, b)                             a + b
  select(x, select)                     x[r, select[r, s]]                       [R, S, ...]
  cast(x; dtype)                        x in another dtype (the logits leave in f32)
  norm_linear(x, n, w[, b]; eps)        linear(rms_norm(x, n), w, b) as one op     (fuse_norm_linears)
  rms_linear(x, w[, b][, n]; eps)       norm_linear with n folded into w: w[:, j] * n[j] rounded once to act
                                        (fold_norm_weights); a tied head keeps n apart (its w is the embedding)

Cache positions a row has not written hold garbage; the mask (p <= the query's position) never reads
them. Runners keep one scratch position past the last real one, where idle rows and padding write.

Passes are opt-in and keep the step's meaning: ``fuse_projections`` (generic: fewer, larger products for
every backend), ``fuse_norm_linears`` and ``fold_norm_weights`` (for backends whose one-token products
stream weights on a CPU: the norm's scale is applied to x once, and its weight lives in the matrix).
``quantize_weights`` stores chosen matrices block-quantised. Fusions, folds and quantised forms are
recorded in ``Program.fused`` / ``Program.folded`` / ``Program.quantized``, the weight plan that
``linnet.weight_plan`` carries out.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from linnet.errors import LinnetError
from linnet.spec import ModelSpec

Shape = tuple[int | str, ...]
SIZES = ("R", "T", "S", "ROWS", "P")  # the symbolic sizes of a step


@dataclass(frozen=True)
class Value:
    shape: Shape
    dtype: str  # "f32" | "f16" | "bf16" | "i64"; a quantised weight's form: "q8_0" | "q4_0" | "q4_1"

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class Op:
    kind: str
    outs: tuple[str, ...]
    inputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        attrs = "".join(f"; {k}={v!r}" for k, v in self.attrs.items())
        return f"{', '.join(self.outs)} = {self.kind}({', '.join(self.inputs)}{attrs})"


@dataclass(frozen=True)
class Section:
    """A pure function: ``params`` in (besides step inputs and weights), ``results`` out."""

    params: tuple[str, ...]
    ops: tuple[Op, ...]
    results: tuple[str, ...]


@dataclass(frozen=True)
class Program:
    spec: ModelSpec
    dtype: str  # the run dtype ("act"): activations and the KV cache
    weight_dtype: str  # the weights' dtype: ``dtype``, or 16 bits under f32 arithmetic
    embed: Section
    layer: Section
    head: Section
    # The weight plan: weights a backend builds by concatenating others along the output axis (name,
    # parts); and weights whose columns it multiplies by a norm's weight (section, weight, norm), the
    # section being "layer" (names within each layer) or "head".
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    folded: tuple[tuple[str, str, str], ...] = ()
    # Matrices stored block-quantised: (section, weight, form), sections as in ``folded``.
    quantized: tuple[tuple[str, str, str], ...] = ()
    int8_activations: bool = False  # products with those matrices round x to int8 first (the docstring)

    def sections(self) -> dict[str, Section]:
        return {"embed": self.embed, "layer": self.layer, "head": self.head}

    def inputs(self) -> dict[str, Value]:
        """The step's inputs other than weights."""
        s, act = self.spec, self.dtype
        cache = Value(("ROWS", s.num_kv_heads, "P", s.head_dim), act)
        return {
            "tokens": Value(("R", "T"), "i64"), "positions": Value(("R", "T"), "i64"),
            "rows": Value(("R",), "i64"), "select": Value(("R", "S"), "i64"),
            "cache_k": cache, "cache_v": cache,  # per layer; the step holds LAYERS of each
            "rope_cos": Value(("P", s.head_dim), "f32"), "rope_sin": Value(("P", s.head_dim), "f32"),
        }

    def __str__(self) -> str:
        return format_program(self)


def build_program(spec: ModelSpec, dtype: str = "f32", weight_dtype: str | None = None) -> Program:
    """The step of ``spec`` computing in ``dtype``, with weights stored in ``weight_dtype`` (default: ``dtype``)."""
    eps = {"eps": spec.rms_norm_eps}

    def linear(out: str, x: str, part: str, biased: bool = False) -> Op:
        return Op("linear", (out,), (x, f"w.{part}", *((f"w.{part}_bias",) if biased else ())))

    ops = [
        Op("rms_norm", ("h",), ("x", "w.attn_norm"), eps),
        linear("q", "h", "q", spec.qkv_bias), linear("k", "h", "k", spec.qkv_bias),
        linear("v", "h", "v", spec.qkv_bias),
        Op("split_heads", ("q_heads",), ("q",), {"heads": spec.num_heads}),
        Op("split_heads", ("k_heads",), ("k",), {"heads": spec.num_kv_heads}),
        Op("split_heads", ("v_heads",), ("v",), {"heads": spec.num_kv_heads}),
    ]
    q, k = "q_heads", "k_heads"
    if spec.qk_norm:
        ops += [Op("rms_norm", ("q_normed",), (q, "w.q_norm"), eps), Op("rms_norm", ("k_normed",), (k, "w.k_norm"), eps)]
        q, k = "q_normed", "k_normed"
    rope = ("positions", "rope_cos", "rope_sin")
    ops += [
        Op("rotary", ("q_rot",), (q, *rope)),
        Op("rotary", ("k_rot",), (k, *rope)),
        Op("cache_write", ("cache_k_out",), ("cache_k", "rows", "positions", "k_rot")),
        Op("cache_write", ("cache_v_out",), ("cache_v", "rows", "positions", "v_heads")),
        Op("attention", ("attn",), ("q_rot", "cache_k_out", "cache_v_out", "rows", "positions")),
        linear("attn_out", "attn", "o", spec.o_bias),
        Op("add", ("x_attn",), ("x", "attn_out")),
        Op("rms_norm", ("h_mlp",), ("x_attn", "w.mlp_norm"), eps),
        linear("gate", "h_mlp", "gate"), linear("up", "h_mlp", "up"),
        Op("swiglu", ("act",), ("gate", "up")),
        linear("mlp_out", "act", "down"),
        Op("add", ("x_out",), ("x_attn", "mlp_out")),
    ]
    program = Program(
        spec=spec,
        dtype=dtype,
        weight_dtype=weight_dtype or dtype,
        embed=Section((), (Op("embedding", ("x",), ("tokens", "w.embed")),), ("x",)),
        layer=Section(("x", "cache_k", "cache_v"), tuple(ops), ("x_out", "cache_k_out", "cache_v_out")),
        head=Section(("x",), (
            Op("select", ("x_sel",), ("x", "select")),
            Op("rms_norm", ("h",), ("x_sel", "w.norm"), eps),
            linear("logits_act", "h", "lm_head"),
            Op("cast", ("logits",), ("logits_act",), {"dtype": "f32"}),
        ), ("logits",)),
    )
    infer_types(program)  # every program built or rewritten here is checked
    return program


# -- shape and dtype inference ------------------------------------------------------------------------

def infer_types(program: Program) -> dict[str, dict[str, Value]]:
    """Each section's values (parameters, step inputs it reads, weights, op outputs) with shape and dtype.

    Raises LinnetError on a program that breaks single assignment, reads an undefined value, or
    combines shapes that do not fit.
    """
    spec, act = program.spec, program.dtype
    shapes = _weight_shapes(program)
    x = Value(("R", "T", spec.hidden_size), act)
    cache = program.inputs()["cache_k"]
    params = {"embed": {}, "layer": {"x": x, "cache_k": cache, "cache_v": cache}, "head": {"x": x}}
    forms = {(section, weight): form for section, weight, form in program.quantized}
    out = {}
    for name, section in program.sections().items():
        env = {**program.inputs(), **params[name]}
        plan_section = "layer" if name == "layer" else "head"
        for op in section.ops:
            for i in op.inputs:
                if i.startswith("w.") and i not in env:
                    if i[2:] not in shapes[name]:
                        raise LinnetError(f"{name}: op {op} reads unknown weight {i}")
                    stored = "embed" if i == "w.lm_head" and spec.tie_word_embeddings else i[2:]
                    dtype = forms.get((plan_section, stored), program.weight_dtype)
                    env[i] = Value(shapes[name][i[2:]], dtype)
                elif i not in env:
                    raise LinnetError(f"{name}: op {op} reads {i!r} before it is assigned")
            results = _infer_op(op, [env[i] for i in op.inputs], spec, act)
            for o, v in zip(op.outs, results, strict=True):
                if o in env:
                    raise LinnetError(f"{name}: {o!r} is assigned twice (op {op})")
                env[o] = v
        missing = [r for r in section.results if r not in env]
        if missing:
            raise LinnetError(f"{name}: results {missing} are never assigned")
        out[name] = env
    return out


def _weight_shapes(program: Program) -> dict[str, dict[str, tuple[int, ...]]]:
    """Weight shapes per section after the plan: the checkpoint's, plus fused weights."""
    from linnet.names import expected_shapes

    spec = program.spec
    layer, top = {}, {}
    for name, shape in expected_shapes(spec).items():
        if name.startswith("layers.0."):
            layer[name.removeprefix("layers.0.")] = shape
        elif not name.startswith("layers."):
            top[name] = shape
    if spec.tie_word_embeddings:
        top["lm_head"] = top["embed"]
    for name, parts in program.fused:
        layer[name] = (sum(layer[p][0] for p in parts), *layer[parts[0]][1:])
    return {"embed": top, "layer": layer, "head": top}


def _infer_op(op: Op, args: list[Value], spec: ModelSpec, act: str) -> list[Value]:
    a = args[0]
    kind = op.kind

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise LinnetError(f"op {op}: {what} (inputs: {', '.join(map(str, args))})")

    if kind == "embedding":
        return [Value((*a.shape, args[1].shape[1]), act)]
    if kind == "rms_norm":
        need(args[1].shape == (a.shape[-1],), "the norm weight must match the last axis")
        return [a]
    if kind in ("linear", "norm_linear", "rms_linear"):
        if kind == "norm_linear":
            need(args[1].shape == (a.shape[-1],), "the norm weight must match x's last axis")
            args = [a, *args[2:]]
        w, extra = args[1], args[2:]
        need(len(w.shape) == 2 and w.shape[1] == a.shape[-1], "the weight's in-size must match x's last axis")
        if op.attrs.get("norm"):  # rms_linear with its norm weight apart, the last input
            need(extra[-1].shape == (a.shape[-1],), "the norm weight must match x's last axis")
            extra = extra[:-1]
        need(all(b.shape == (w.shape[0],) for b in extra) and len(extra) <= 1, "a bias must match the out-size")
        return [Value((*a.shape[:-1], w.shape[0]), a.dtype)]
    if kind == "split":
        sizes = op.attrs["sizes"]
        need(sum(sizes) == a.shape[-1] and len(sizes) == len(op.outs), "sizes must cover the last axis")
        return [Value((*a.shape[:-1], n), a.dtype) for n in sizes]
    if kind == "split_heads":
        heads = op.attrs["heads"]
        need(a.shape[-1] == heads * spec.head_dim, "the last axis must be heads x head_dim")
        return [Value((*a.shape[:-1], heads, spec.head_dim), a.dtype)]
    if kind == "rotary":
        need(a.shape[-1] == spec.head_dim and args[1].shape == a.shape[:2], "x [R, T, heads, HEAD_DIM]")
        return [a]
    if kind == "cache_write":
        need(args[3].shape[2:] == a.shape[1:2] + a.shape[3:], "values must match the cache's heads and head_dim")
        return [a]
    if kind == "attention":
        need(a.shape[2] % args[1].shape[1] == 0, "query heads must be a multiple of key/value heads")
        return [Value((*a.shape[:2], a.shape[2] * a.shape[3]), a.dtype)]
    if kind in ("swiglu", "add"):
        need(a.shape == args[1].shape and a.dtype == args[1].dtype, "both inputs must have one shape and dtype")
        return [a]
    if kind == "select":
        return [Value((a.shape[0], args[1].shape[1], *a.shape[2:]), a.dtype)]
    if kind == "cast":
        return [Value(a.shape, op.attrs["dtype"])]
    raise LinnetError(f"unknown op kind {kind!r}")


# -- passes -------------------------------------------------------------------------------------------

# Projections that read the same input, fused into one wider matrix: one pass over the input, fewer and
# larger matrix products (on CPUs the matrix-vector products of decode are bandwidth-bound, and larger
# ones get closer to the bandwidth).
_FUSIONS = {("q", "k", "v"): "qkv", ("gate", "up"): "gate_up"}


def fuse_projections(program: Program) -> Program:
    """Replace the q/k/v and gate/up linears by one linear each, followed by a split."""
    ops, fused, i = list(program.layer.ops), [], 0
    types = infer_types(program)["layer"]
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
                outs = tuple(op.outs[0] for op in run)
                sizes = tuple(types[o].shape[-1] for o in outs)
                ops[i:i + len(parts)] = [Op("linear", (name,), inputs), Op("split", outs, (name,), {"sizes": sizes})]
                break
        i += 1
    return _checked(replace(program, layer=replace(program.layer, ops=tuple(ops)), fused=program.fused + tuple(fused)))


def fuse_norm_linears(program: Program) -> Program:
    """Each RMS norm whose output only one linear reads becomes one ``norm_linear``.

    Run after fuse_projections, which leaves one linear after each norm. A backend can then apply the
    norm's per-token scale once to x, instead of inside the product.
    """
    def fuse(section: Section) -> Section:
        readers = _readers(section)

        def only_linear_reads(norm: Op) -> bool:
            r = readers[norm.outs[0]]
            return len(r) == 1 and r[0] is not None and r[0].kind == "linear" and r[0].inputs[0] == norm.outs[0]

        norms = {op.outs[0]: op for op in section.ops if op.kind == "rms_norm" and only_linear_reads(op)}
        out = []
        for op in section.ops:
            if op.kind == "rms_norm" and op.outs[0] in norms:
                continue  # becomes part of the linear that reads it
            if op.kind == "linear" and op.inputs[0] in norms:
                norm = norms[op.inputs[0]]
                op = Op("norm_linear", op.outs, (*norm.inputs, *op.inputs[1:]), norm.attrs)
            out.append(op)
        return replace(section, ops=tuple(out))

    return _checked(replace(program, layer=fuse(program.layer), head=fuse(program.head)))


def fold_norm_weights(program: Program) -> Program:
    """Each norm_linear becomes an rms_linear over its weight with the norm's weight folded in.

    rms_norm(x, n) @ w.T == (x * scale) @ (w * n).T, with scale = rsqrt(mean(x^2) + eps) per token; the
    weight plan multiplies the weight's columns once, so a one-token step reads plain weights against
    plain x. A tied head keeps its norm weight apart (its n stays an input): its matrix is the
    embedding too, and a folded copy would add the embedding's size to the memory a process maps.
    """
    folded = []
    tied = program.spec.tie_word_embeddings

    def fold(name: str, section: Section) -> Section:
        out = []
        for op in section.ops:
            if op.kind == "norm_linear":
                x, n, w, *b = op.inputs
                if tied and w == "w.lm_head":
                    op = Op("rms_linear", op.outs, (x, w, *b, n), {**op.attrs, "norm": True})
                else:
                    folded.append((name, w.removeprefix("w."), n.removeprefix("w.")))
                    op = Op("rms_linear", op.outs, (x, w, *b), op.attrs)
            out.append(op)
        return replace(section, ops=tuple(out))

    layer, head = fold("layer", program.layer), fold("head", program.head)
    return _checked(replace(program, layer=layer, head=head, folded=program.folded + tuple(folded)))


def quantize_weights(program: Program, forms: dict[tuple[str, str], str], int8_activations: bool = False) -> Program:
    """Store the matrices ``forms`` names, (section, weight) -> form, block-quantised in that form; with
    ``int8_activations``, their products round x to int8 per block first (the module's docstring)."""
    from linnet.quantize import ELEMENTS, FORMS, check_form

    shapes = _weight_shapes(program)
    for (section, weight), form in forms.items():
        check_form(form, f"{section} weight {weight!r}", tuple(FORMS))
        shape = shapes["layer" if section == "layer" else "head"].get(weight)
        if shape is None or len(shape) != 2 or shape[1] % ELEMENTS[form]:
            raise LinnetError(f"{section} weight {weight!r} ({shape}) is not a matrix of whole "
                              f"{ELEMENTS[form]}-blocks")
    quantized = tuple((section, weight, form) for (section, weight), form in forms.items())
    return _checked(replace(program, quantized=program.quantized + quantized, int8_activations=int8_activations))


def _readers(section: Section) -> dict[str, list[Op | None]]:
    """The ops that read each value; None stands for the section's caller, for a result."""
    readers: dict[str, list[Op | None]] = {o: [] for op in section.ops for o in op.outs}
    for op in section.ops:
        for i in op.inputs:
            readers.setdefault(i, []).append(op)
    for r in section.results:
        readers.setdefault(r, []).append(None)
    return readers


def _checked(program: Program) -> Program:
    infer_types(program)
    return program


# -- text ---------------------------------------------------------------------------------------------

def format_program(program: Program) -> str:
    """The program as text: the signature, then each section's ops with their values' types."""
    spec = program.spec
    types = infer_types(program)
    weights = "" if program.weight_dtype == program.dtype else f", weights {program.weight_dtype}"
    lines = [
        f"# {spec.architecture}: {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_heads} heads "
        f"({spec.num_kv_heads} for keys and values) of {spec.head_dim}, vocabulary {spec.vocab_size}; "
        f"run dtype {program.dtype}{weights}",
        "step(" + ", ".join(f"{n}: {v}" for n, v in program.inputs().items()) + ", weights)",
        "  -> logits, cache_k', cache_v'   (cache_k/cache_v: one per layer)",
    ]
    for name, section in program.sections().items():
        env = types[name]
        params = ", ".join(f"{p}: {env[p]}" for p in section.params)
        lines += ["", f"{name}({params}):" + ("   # applied once per layer, w.* = layers.<i>.*" if name == "layer" else "")]
        for op in section.ops:
            lines.append(f"  {op}    # {', '.join(str(env[o]) for o in op.outs)}")
        lines.append(f"  return {', '.join(section.results)}")
    for title, names in (("weights, per layer (layers.<i>.*)", ("layer",)), ("weights", ("embed", "head"))):
        found = {n: v for section in names for n, v in types[section].items() if n.startswith("w.")}
        lines += ["", f"{title}:"] + [f"  {n[2:]}: {v}" for n, v in sorted(found.items())]
    if program.fused or program.folded or program.quantized:
        lines += ["", "weight plan:"]
        lines += [f"  {name} = concat({', '.join(parts)})" for name, parts in program.fused]
        lines += [f"  {section}: {w} *= {n} (columns)" for section, w, n in program.folded]
        lines += [f"  {section}: {w} in {form} blocks" for section, w, form in program.quantized]
        if program.int8_activations:
            lines.append("  products with blocks round x to int8 per block")
    if spec.tie_word_embeddings:
        lines.append("  lm_head = embed (tied)")
    return "\n".join(lines) + "\n"
