"""The Program's data: typed single-assignment values, ops, sections, and the program itself.

What each op means is defined in ``linnet.program``'s docstring (and executed by
``linnet.backends.reference``); what each op's inputs and outputs must be is ``linnet.program.ops``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from linnet.errors import LinnetError
from linnet.spec import ModelSpec

Shape = tuple[int | str, ...]
SIZES = ("R", "T", "S", "ROWS", "P")  # the symbolic sizes of a step


@dataclass(frozen=True)
class Value:
    shape: Shape
    dtype: str  # "f32" | "f16" | "bf16" | "i64"; a quantised weight's form: "q8_0" | "q4_0" | "q4_1" | ...

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
    dtype: str  # the run dtype ("act"): activations, and the KV cache unless the weights are 16-bit
    weight_dtype: str  # the weights' dtype: ``dtype``, or 16 bits under f32 arithmetic (and cache)
    embed: Section
    # The layer sections by kind ("full", "sliding", "nope", ...), and the kind of each layer in order.
    kinds: dict[str, Section]
    layer_kinds: tuple[str, ...]
    head: Section
    # Every weight's shape as the checkpoint holds it (before the weight plan): global names, and the
    # names within one layer of each kind.
    weight_shapes: dict[str, tuple[int, ...]]
    layer_weight_shapes: dict[str, dict[str, tuple[int, ...]]]
    # The weight plan: weights a backend builds by concatenating others along the output axis (name,
    # parts); and weights whose columns it multiplies by a norm's weight (section, weight, norm), the
    # section being "layer" (names within each layer) or "head".
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    folded: tuple[tuple[str, str, str], ...] = ()
    # Matrices stored block-quantised: (section, weight, form), sections as in ``folded``.
    quantized: tuple[tuple[str, str, str], ...] = ()
    int8_activations: bool = False  # products with those matrices round x to int8 first (the docstring)

    @property
    def layer(self) -> Section:
        """The layer section of a program whose layers are all of one kind."""
        if len(self.kinds) != 1:
            raise LinnetError(f"the program has layers of kinds {sorted(self.kinds)}; use layer_section(i)")
        return next(iter(self.kinds.values()))

    def layer_section(self, i: int) -> Section:
        return self.kinds[self.layer_kinds[i]]

    def sections(self) -> dict[str, Section]:
        """Every section by name: "embed", the layer kinds ("layer" when there is one, else
        "layer.<kind>"), "head"."""
        return {"embed": self.embed, **{layer_section_name(self, k): s for k, s in self.kinds.items()},
                "head": self.head}

    def inputs(self) -> dict[str, Value]:
        """The step's inputs other than weights."""
        return step_inputs(self.spec, self.dtype, self.cache_dtype)

    @property
    def cache_dtype(self) -> str:
        """The KV cache's dtype (``cache_dtype``)."""
        return cache_dtype(self.dtype, self.weight_dtype)

    def ring(self, kind: str) -> int | None:
        """The slots of the ring cache that layers of ``kind`` keep (their ``cache_write``'s ``ring``,
        ``linnet.program.rings``), or None where their cache holds every position."""
        slots = {op.attrs.get("ring") for op in self.kinds[kind].ops if op.kind == "cache_write"}
        if len(slots) > 1:
            raise LinnetError(f"layers of kind {kind!r} write caches of several forms ({slots}); a layer has one")
        return next(iter(slots), None)

    def cache_input(self, kind: str) -> Value:
        """The cache_k (and cache_v) a layer of ``kind`` takes: [ROWS, KV_HEADS, P, HEAD_DIM], or a ring's
        [ROWS, KV_HEADS, ring + 1, HEAD_DIM] (its slots, then the scratch slot)."""
        cache = self.inputs()["cache_k"]
        slots = self.ring(kind)
        return cache if slots is None else Value((cache.shape[0], cache.shape[1], slots + 1, cache.shape[3]),
                                                 cache.dtype)

    def cache_slots(self, kind: str, positions: int) -> int:
        """The positions a layer of ``kind`` allocates for a cache of ``positions`` real ones: its ring's
        slots or every position, and the scratch position after them."""
        return (self.ring(kind) or positions) + 1

    def cache_bytes_per_row(self, positions: int, dtype: str | None = None) -> int:
        """The keys and values one cache row holds over ``positions``, every layer, in the cache's dtype (or
        ``dtype``, where a backend keeps it wider): a ring layer's its ring's slots (``linnet.program.rings``);
        neither counts its scratch slot."""
        from linnet.dtypes import DTYPES

        s = self.spec
        held = sum(self.ring(kind) or positions for kind in self.layer_kinds)
        return 2 * s.num_kv_heads * s.head_dim * held * DTYPES[dtype or self.cache_dtype].numpy.itemsize

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every canonical tensor the checkpoint must hold, with its shape (``layers.<i>.<name>``)."""
        shapes = dict(self.weight_shapes)
        for i, kind in enumerate(self.layer_kinds):
            shapes.update({f"layers.{i}.{n}": s for n, s in self.layer_weight_shapes[kind].items()})
        return shapes

    def __str__(self) -> str:
        from linnet.program.printer import format_program

        return format_program(self)


def cache_dtype(dtype: str, weight_dtype: str) -> str:
    """The KV cache's dtype: the run dtype, or 16-bit weights' under f32 arithmetic (a CPU's 16-bit run),
    whose keys and values are then as narrow as the weights, as in a 16-bit run on a GPU or llama.cpp's
    f16 cache: half the bytes a decode step reads from the cache, and half its memory."""
    return weight_dtype if weight_dtype in ("bf16", "f16") else dtype


def step_inputs(spec: ModelSpec, act: str, cache: str | None = None) -> dict[str, Value]:
    """The step's inputs other than weights: activations in ``act``, the KV cache in ``cache`` (default act)."""
    kv = Value(("ROWS", spec.num_kv_heads, "P", spec.head_dim), cache or act)
    tables = Value(("P", spec.rotary_dim * spec.rope_table_count), "f32")  # the rotary tables side by side
    return {
        "tokens": Value(("R", "T"), "i64"), "positions": Value(("R", "T"), "i64"),
        "rows": Value(("R",), "i64"), "select": Value(("R", "S"), "i64"),
        "cache_k": kv, "cache_v": kv,  # per layer; the step holds LAYERS of each
        "rope_cos": tables, "rope_sin": tables,
    }


def layer_section_name(program: Program, kind: str) -> str:
    return "layer" if len(program.kinds) == 1 else f"layer.{kind}"


def plan_section(section: str) -> str:
    """The weight plan's section of a program section: "layer" for every layer kind, else "head"."""
    return "layer" if section.startswith("layer") else "head"
