"""OpenMP `schedule(guided)` for the work-shared loops of the compiled decode step.

Inductor writes every parallel CPU loop as `#pragma omp for`, which libgomp splits statically: each
thread gets an equal share and the step waits at each loop's end for the slowest. On a shared 2-core
VM the threads are often not equal (one core slower, or woken late from a passive wait), so one
idles at every barrier of the ~300 in a step. Guided hands out shrinking chunks, first come first
served, so a late or slow thread simply takes less.

Inductor has no setting for this, so one method of its C++ code generator is wrapped (torch is pinned).
The wrapper acts only inside a compile whose config carries `GUIDED_LOOPS` as its post-grad pass;
the pass changes nothing in the graph, and its uuid keeps those compiles apart in inductor's on-disk
cache. Parallel reductions keep the static schedule, whose fixed split keeps their sums deterministic.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass


class GuidedLoops(CustomGraphPass):
    """Marks a compile for guided loops; as a graph pass it does nothing."""

    def __call__(self, graph: torch.fx.graph.Graph) -> None:
        return None

    def uuid(self) -> Any:
        return "linnet-guided-omp-loops-1"


GUIDED_LOOPS = GuidedLoops()


def guided_loop_options() -> dict[str, Any]:
    """torch.compile options that schedule the compiled graph's parallel loops guided, for any graph
    compiled with them (installing the code generator's wrapper once per process)."""
    _install()
    return {"post_grad_custom_post_pass": GUIDED_LOOPS}


def _install() -> None:
    from torch._inductor.codegen.cpp import LoopLevel

    if getattr(LoopLevel.lines, "_linnet_guided", False):
        return
    original = LoopLevel.lines

    def lines(self: LoopLevel) -> list[str] | None:
        out = original(self)
        guided = isinstance(inductor_config.post_grad_custom_post_pass, GuidedLoops)
        if guided and out and not self.is_reduction and out[0].startswith("#pragma omp for"):
            out = ["#pragma omp for schedule(guided)" + out[0][len("#pragma omp for"):], *out[1:]]
        return out

    lines._linnet_guided = True
    LoopLevel.lines = lines
