"""Type inference, and the passes that rewrite a Program while keeping its step's meaning.

``fuse_projections`` (generic: fewer, larger products for every backend), ``fuse_norm_linears`` and
``fold_norm_weights`` (for backends whose one-token products stream weights on a CPU: the norm's scale is
applied to x once, and its weight lives in the matrix), ``quantize_weights`` (chosen matrices stored
block-quantised), and ``lower`` (composites an emitter has no native form for, replaced by their
decompositions). Fusions, folds and quantised forms are recorded in ``Program.fused`` /
``Program.folded`` / ``Program.quantized``, the weight plan that ``linnet.weight_plan`` carries out.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from linnet.errors import LinnetError, UnsupportedModel
from linnet.program.ir import Op, Program, Section, Value, layer_section_name, plan_section
from linnet.program.ops import OPS, infer_op
from linnet.quantize import ELEMENTS, FORMS, MADE, check_form


def infer_types(program: Program) -> dict[str, dict[str, Value]]:
    """Each section's values (parameters, step inputs it reads, weights, op outputs) with shape and dtype,
    by section name (``Program.sections``).

    Raises LinnetError on a program that breaks single assignment, reads an undefined value, or
    combines shapes that do not fit.
    """
    spec, act = program.spec, program.dtype
    x = Value(("R", "T", spec.hidden_size), act)
    caches = {layer_section_name(program, kind): program.cache_input(kind) for kind in program.kinds}
    forms = {(section, weight): form for section, weight, form in program.quantized}
    out = {}
    for name, section in program.sections().items():
        layer = {"x": x, "cache_k": caches[name], "cache_v": caches[name]} if name in caches else {}
        params = {"embed": {}, "head": {"x": x}}.get(name, layer)
        env: dict[str, Value] = {**program.inputs(), **params}
        shapes = _weight_shapes(program, name)
        for op in section.ops:
            for i in op.inputs:
                if i.startswith("w.") and i not in env:
                    if i[2:] not in shapes:
                        raise LinnetError(f"{name}: op {op} reads unknown weight {i}")
                    stored = "embed" if i == "w.lm_head" and spec.tie_word_embeddings else i[2:]
                    dtype = forms.get((plan_section(name), stored), program.weight_dtype)
                    env[i] = Value(shapes[i[2:]], dtype)
                elif i not in env:
                    raise LinnetError(f"{name}: op {op} reads {i!r} before it is assigned")
            results = infer_op(op, [env[i] for i in op.inputs], spec, act)
            for o, v in zip(op.outs, results, strict=True):
                if o in env:
                    raise LinnetError(f"{name}: {o!r} is assigned twice (op {op})")
                env[o] = v
        missing = [r for r in section.results if r not in env]
        if missing:
            raise LinnetError(f"{name}: results {missing} are never assigned")
        out[name] = env
    return out


def _weight_shapes(program: Program, section: str) -> dict[str, tuple[int, ...]]:
    """A section's weight shapes after the plan: the checkpoint's, plus fused weights."""
    if not section.startswith("layer"):
        top = dict(program.weight_shapes)
        if program.spec.tie_word_embeddings:
            top["lm_head"] = top["embed"]
        return top
    kind = next(k for k in program.kinds if layer_section_name(program, k) == section)
    layer = dict(program.layer_weight_shapes[kind])
    for name, parts in program.fused:
        if all(p in layer for p in parts):
            layer[name] = (sum(layer[p][0] for p in parts), *layer[parts[0]][1:])
    return layer


def checked(program: Program) -> Program:
    infer_types(program)
    return program


def map_layers(program: Program, rewrite) -> Program:
    """``program`` with each layer kind's section rewritten by ``rewrite(section)``."""
    return replace(program, kinds={k: rewrite(s) for k, s in program.kinds.items()})


# Projections that read the same input, fused into one wider matrix: one pass over the input, fewer and
# larger matrix products (on CPUs the matrix-vector products of decode are bandwidth-bound, and larger
# ones get closer to the bandwidth).
_FUSIONS = {("q", "k", "v"): "qkv", ("gate", "up"): "gate_up"}


def fuse_projections(program: Program) -> Program:
    """Replace the q/k/v and gate/up linears by one linear each, followed by a split."""
    fused: list[tuple[str, tuple[str, ...]]] = []
    types = infer_types(program)

    def fuse(kind: str, section: Section) -> Section:
        ops, i = list(section.ops), 0
        env = types[layer_section_name(program, kind)]
        while i < len(ops):
            for parts, name in _FUSIONS.items():
                run = ops[i:i + len(parts)]
                if [op.kind for op in run] == ["linear"] * len(parts) and \
                        [op.inputs[1] for op in run] == [f"w.{p}" for p in parts] and \
                        len({op.inputs[0] for op in run}) == 1:
                    biased = [len(op.inputs) == 3 for op in run]
                    if any(biased) and not all(biased):
                        break  # a partly biased run would need zero biases invented: leave it unfused
                    inputs: tuple[str, ...] = (run[0].inputs[0], f"w.{name}")
                    plan = [(name, parts)]
                    if all(biased):
                        inputs += (f"w.{name}_bias",)
                        plan.append((f"{name}_bias", tuple(f"{p}_bias" for p in parts)))
                    fused.extend(p for p in plan if p not in fused)
                    outs = tuple(op.outs[0] for op in run)
                    sizes = tuple(env[o].shape[-1] for o in outs)
                    ops[i:i + len(parts)] = [Op("linear", (name,), inputs),
                                             Op("split", outs, (name,), {"sizes": sizes})]
                    break
            i += 1
        return replace(section, ops=tuple(ops))

    kinds = {k: fuse(k, s) for k, s in program.kinds.items()}
    return checked(replace(program, kinds=kinds, fused=program.fused + tuple(fused)))


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

    return checked(replace(map_layers(program, fuse), head=fuse(program.head)))


def fold_norm_weights(program: Program) -> Program:
    """Each norm_linear becomes an rms_linear over its weight with the norm's weight folded in.

    rms_norm(x, n) @ w.T == (x * scale) @ (w * n).T, with scale = rsqrt(mean(x^2) + eps) per token; the
    weight plan multiplies the weight's columns once, so a one-token step reads plain weights against
    plain x. A tied head keeps its norm weight apart (its n stays an input): its matrix is the
    embedding too, and a folded copy would add the embedding's size to the memory a process maps.
    """
    folded: list[tuple[str, str, str]] = []
    tied = program.spec.tie_word_embeddings

    def fold(name: str, section: Section) -> Section:
        out = []
        for op in section.ops:
            if op.kind == "norm_linear":
                x, n, w, *b = op.inputs
                if tied and w == "w.lm_head":
                    op = Op("rms_linear", op.outs, (x, w, *b, n), {**op.attrs, "norm": True})
                else:
                    entry = (name, w.removeprefix("w."), n.removeprefix("w."))
                    if entry not in folded:
                        folded.append(entry)
                    op = Op("rms_linear", op.outs, (x, w, *b), op.attrs)
            out.append(op)
        return replace(section, ops=tuple(out))

    layers = map_layers(program, lambda s: fold("layer", s))
    return checked(replace(layers, head=fold("head", program.head), folded=program.folded + tuple(folded)))


def quantize_weights(program: Program, forms: dict[tuple[str, str], str], int8_activations: bool = False) -> Program:
    """Store the matrices ``forms`` names, (section, weight) -> form, block-quantised in that form; with
    ``int8_activations``, their products round x to int8 per block first (the package docstring)."""
    for (section, weight), form in forms.items():
        check_form(form, f"{section} weight {weight!r}", tuple(FORMS))
        shapes = [_weight_shapes(program, layer_section_name(program, k)) for k in program.kinds] \
            if section == "layer" else [_weight_shapes(program, "head")]
        if any(weight not in s for s in shapes):  # the weight plan quantises a layer weight in every layer
            raise LinnetError(f"{section} weight {weight!r} is in some layer kinds only; storing it in blocks "
                              "is not supported yet")
        found = {s[weight] for s in shapes}
        shape = found.pop() if len(found) == 1 else None
        if shape is None or len(shape) not in (2, 3) or shape[-1] % ELEMENTS[form]:
            raise LinnetError(f"{section} weight {weight!r} ({shape}) is not a matrix (or a stack of experts' "
                              f"matrices) of whole {ELEMENTS[form]}-blocks")
    quantized = tuple((section, weight, form) for (section, weight), form in forms.items())
    return checked(replace(program, quantized=program.quantized + quantized, int8_activations=int8_activations))


def block_forms(program: Program, weights: Any, quantize: str, runs: tuple[str, ...] = MADE,
                stacks: tuple[str, ...] = ()) -> dict[tuple[str, str], str]:
    """(section, matrix) -> block form of the matrices ``quantize`` puts in blocks: "none", none; a form
    (``linnet.quantize.MADE``), every matrix; "gguf", each matrix that ``weights`` (a GGUF file's) stores
    in a form the backend ``runs``. The experts' stacks of a ``moe`` ([experts, out, in]) are matrices
    here too where the backend runs them in the form, ``stacks``. The result goes to
    ``quantize_weights``."""
    if quantize == "none":
        return {}
    types = infer_types(program)  # by program section: "layer", or "layer.<kind>" with several kinds
    moes = [op for section in program.sections().values() for op in section.ops if op.kind == "moe"]
    expert_stacks = {op.inputs[i] for op in moes for i in (2, 3, 4)}
    expert_biases = {name for op in moes for name in op.inputs[5:]}  # [experts, out]: no matrices
    matrices, stack_names = set(), set()
    for section, env in types.items():
        for name, value in env.items():
            if name.startswith("w.") and name not in expert_biases and (len(value.shape) == 2 or name in expert_stacks):
                matrices.add((plan_section(section), name[2:]))
                if name in expert_stacks:
                    stack_names.add((plan_section(section), name[2:]))
    if program.spec.tie_word_embeddings:
        matrices.discard(("head", "lm_head"))  # it is the embedding

    def runnable(entry: tuple[str, str], form: str) -> bool:
        return form in (stacks if entry in stack_names else runs)

    if quantize != "gguf":
        check_form(quantize)
        return {entry: quantize for entry in sorted(matrices) if runnable(entry, quantize)}
    stored = getattr(weights, "blocks", {})  # name -> (form, bytes)
    parts = dict(program.fused)
    forms = {}
    for section, name in sorted(matrices):
        prefixes = [f"layers.{i}." for i in range(program.spec.num_layers)] if section == "layer" else [""]
        found = {stored.get(prefix + part, ("",))[0] for prefix in prefixes for part in parts.get(name, (name,))}
        if len(found) == 1 and runnable((section, name), next(iter(found))):
            forms[section, name] = found.pop()
    return forms


def lower(program: Program, native: set[str] | frozenset[str]) -> Program:
    """Every op an emitter does not lower natively (``native``) replaced by its decomposition, until
    only native ops are left; an op with neither is an error naming it."""
    def expand(section: Section) -> Section:
        taken = {o for op in section.ops for o in op.outs} | set(section.params)

        def fresh(hint: str) -> str:
            name, n = hint, 1
            while name in taken:
                n += 1
                name = f"{hint}_{n}"
            taken.add(name)
            return name

        def ops_of(op: Op) -> list[Op]:
            if op.kind in native:
                return [op]
            decompose = OPS[op.kind].decompose
            if decompose is None:
                raise UnsupportedModel(f"this backend does not run the {op.kind} op yet: it has no native form "
                                       "of it, and the op has no decomposition")
            return [o for part in decompose(op, fresh) for o in ops_of(part)]

        return replace(section, ops=tuple(o for op in section.ops for o in ops_of(op)))

    lowered = replace(map_layers(program, expand), embed=expand(program.embed), head=expand(program.head))
    return checked(lowered)


def _readers(section: Section) -> dict[str, list[Op | None]]:
    """The ops that read each value; None stands for the section's caller, for a result."""
    readers: dict[str, list[Op | None]] = {o: [] for op in section.ops for o in op.outs}
    for op in section.ops:
        for i in op.inputs:
            readers.setdefault(i, []).append(op)
    for r in section.results:
        readers.setdefault(r, []).append(None)
    return readers
