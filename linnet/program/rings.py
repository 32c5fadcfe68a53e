"""Ring caches: a sliding layer's cache keeps the positions its window can still read, not every position.

A runner writes at most ``chunk`` tokens of a row in one step (its prefill chunk), then attends. A query
at position q of a layer with window W reads positions q - W + 1 .. q, while the step's later tokens
write up to q + chunk - 1. A ring of N = W + chunk - 1 slots, position p at slot p mod N, therefore still
holds every position a query of the step can see after the step's own writes (the next writer of the
oldest one's slot, oldest + N = q + chunk, comes in a later step). Its extra slot N takes the writes of
the scratch position (idle rows, padding), which no query sees. Gemma 3 (5 sliding layers of 1024 to
each global one) at 8192 positions and chunks of 256 holds 0.30 of the full cache.

``ring_caches`` is the pass that turns a Program's sliding layer kinds into rings; the Program's
docstring defines ``cache_write`` and ``attention`` on a ring.
"""
from __future__ import annotations

from dataclasses import replace

from linnet.program.ir import Op, Program, Section
from linnet.program.passes import checked, map_layers

RING_OPS = ("cache_write", "attention")


def ring_slots(window: int, chunk: int, positions: int) -> int | None:
    """The slots of the ring of a layer with ``window`` written in steps of at most ``chunk`` tokens a row,
    or None where it would hold no fewer than the cache's ``positions``."""
    slots = window + chunk - 1
    return slots if slots < positions else None


def ring_caches(program: Program, positions: int, chunk: int, scratch: int) -> Program:
    """``program`` with each layer kind whose attention has a window keeping a ring cache (``ring_slots``)
    where that is smaller than the cache's ``positions``; ``scratch`` is the runner's scratch position.
    Every other kind, and every program without windows, is left as it is."""
    def ring(section: Section) -> Section:
        windows = {op.attrs.get("window") for op in section.ops if op.kind == "attention"}
        window = windows.pop() if len(windows) == 1 else None
        slots = None if window is None else ring_slots(window, chunk, positions)
        if slots is None:
            return section
        attrs = {"cache_write": {"ring": slots, "scratch": scratch}, "attention": {"ring": slots}}
        return replace(section, ops=tuple(Op(op.kind, op.outs, op.inputs, {**op.attrs, **attrs[op.kind]})
                                          if op.kind in RING_OPS else op for op in section.ops))

    return checked(map_layers(program, ring))


def rings(program: Program) -> frozenset[tuple[int, int]]:
    """(slots, window) of each ring the program's layers keep."""
    return frozenset((op.attrs["ring"], op.attrs["window"]) for section in program.kinds.values()
                     for op in section.ops if op.kind == "attention" and "ring" in op.attrs)
