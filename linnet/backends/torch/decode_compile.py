"""How inductor compiles the one-token decode step.

Decode reads every weight once per token, so the step runs as fast as its weight-streaming loops (one
per product: a multiply-and-sum over [out, rows, in]) read memory. The options below keep those loops
doing nothing but that, each measured in one process against the step without it (docs/BENCH.md):

- `realize_reads_threshold=1`: a value that several loops read (the residual stream) is written once
  instead of recomputed in each of them.
- `DecodeStepPass` writes each product's input (the norm-scaled activation, times the norm's weight
  for a tied head; attention's rotated query, and its softmax, against the KV cache) to a buffer first;
  inductor would otherwise inline that pointwise work into the product's inner loop, where it is redone
  for every row of the weights, or every cache position.
- `-ffp-contract=fast`: each multiply-and-add of those loops is one fused instruction.
- `emulate_precision_casts`: a 16-bit value the step rounds to stays rounded inside a fused loop, so
  that one row's step gives what a step of several rows gives.
- `schedule(guided)` on every work-shared loop: inductor writes `#pragma omp for`, which libgomp splits
  statically, each thread an equal share, and the step waits at each loop's end for the slowest. On a
  shared VM the threads are often not equal (a slower core, a thread woken late), so guided hands out
  shrinking chunks, first come first served. Inductor has no setting for this, so one method of its
  C++ code generator is wrapped (torch is pinned), acting only in compiles whose post-grad pass is a
  `DecodeStepPass`. Parallel reductions keep the static schedule, whose fixed split keeps their sums
  deterministic.
- A prefetch ahead of each stream: every contiguous vector load of floating-point values from a buffer
  larger than the L2 cache (a weight matrix, a layer's KV cache) is preceded by a software prefetch
  `PREFETCH_BYTES` further on. The CPUs' own prefetchers left a one-row loop over bf16 weights at
  70-80% of what a plain sum of memory reads; 2-8 KB ahead they read as fast as it (docs/NOTEBOOK.md,
  2026-12-07). Not for the integer codes of a matrix in blocks: those loops are bound by their
  arithmetic, and the prefetches slowed SmolLM2's Q4_1 decode by a fifth. A prefetch never faults, so
  one past a buffer's end is harmless. Wrapped the same way, in the same compiles.

The pass's uuid is in inductor's cache key, so a change here must change it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

aten = torch.ops.aten
_VIEWS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
    aten.select.int, aten.slice.Tensor, aten.unsqueeze.default, aten.squeeze.dim,
    aten.permute.default, aten.expand.default, aten.t.default, aten.transpose.int,
}


_CASTS = {torch.ops.prims.convert_element_type.default, aten._to_copy.default}


def _through(node: Any, ops: set) -> Any:
    """The node a value is computed from by ``ops`` (views; and casts, for a 16-bit weight widened in the loop)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in ops:
        node = node.args[0]
    return node


def product_inputs(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The pointwise-computed activations that a multiply-and-sum with a weight, or with the KV cache,
    reads (a reduction's output is a buffer already and keeps the layout it has). The sum is over a
    product or a sum of products (a 4-bit block's low and high halves); a weight is a graph input, or
    computed from graph inputs alone by pointwise ops (a matrix in blocks, dequantised in the loop); the
    cache's keys and values are gathered from a graph input (``_from_memory``). So attention's rotated,
    scaled query is written once, not recomputed for every cache position its loop reads (Phi-3.5-mini's
    shapes at 1,024 positions: a third of the decode step), nor its softmax's division for every value."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target != aten.sum.dim_IntList:
            continue
        term = node.args[0]
        terms = term.args if isinstance(term, torch.fx.Node) and term.target == aten.add.Tensor else (term,)
        for mul in terms:
            if not (isinstance(mul, torch.fx.Node) and mul.target == aten.mul.Tensor):
                continue
            for weight, activation in (mul.args, mul.args[::-1]):
                # through views only: an input rounded to 16 bits and widened again is realized as the
                # product reads it, so that the rounding is done once, not again for every weight row
                activation = _through(activation, _VIEWS)
                if (_from_memory(weight) and _is_pointwise(activation) and not _from_memory(activation)
                        and activation not in found):
                    found.append(activation)
    return found


def _from_weights(node: Any) -> bool:
    """Whether a value is computed from graph inputs or constants (weights: an exported step's are
    constants, `get_attr`) alone, through views, casts and pointwise ops."""
    node = _through(node, _VIEWS | _CASTS)
    if not isinstance(node, torch.fx.Node) or node.op in ("placeholder", "get_attr"):
        return True
    return _is_pointwise(node) and all(_from_weights(arg) for arg in node.all_input_nodes)


_GATHERS = {aten.index.Tensor, aten.index_select.default, aten.index_put.default, aten.index_put_.default}


def _from_memory(node: Any) -> bool:
    """Whether a product's operand streams from memory: a weight (``_from_weights``), or a gather from
    one, such as the rows and positions of the KV cache (a graph input, as the step's write left it)."""
    if _from_weights(node):
        return True
    node = _through(node, _VIEWS | _CASTS)
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _GATHERS
            and _from_memory(node.args[0]))


def _is_pointwise(node: Any) -> bool:
    """A node computing a pointwise aten op (a Python function such as a split's getitem has no tags)."""
    return (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and torch.Tag.pointwise in getattr(node.target, "tags", ()))


class DecodeStepPass(CustomGraphPass):
    """Post-grad pass: each product's input is realized (written to a buffer) before the product."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in product_inputs(graph):
            node.meta["inductor_realize_to_strides"] = True  # lowering realizes such a node's value

    def uuid(self) -> Any:
        return "linnet-decode-step-8"


DECODE_STEP_PASS = DecodeStepPass()


def decode_compile_options() -> dict[str, Any]:
    """torch.compile options for the decode step (installing the guided-loop wrapper once per process)."""
    _install_guided_loops()
    _install_prefetching_loads()
    return {
        "realize_reads_threshold": 1,
        "post_grad_custom_post_pass": DECODE_STEP_PASS,
        "cpp.enable_floating_point_contract_flag": "fast",
        # keep the roundings the generated code asks for (16-bit products' inputs and results, see its
        # `linear`), which inductor would otherwise drop inside a fused loop
        "emulate_precision_casts": True,
    }


def _install_guided_loops() -> None:
    from torch._inductor.codegen.cpp import LoopLevel

    if getattr(LoopLevel.lines, "_linnet_guided", False):
        return
    original = LoopLevel.lines

    def lines(self: LoopLevel) -> list[str] | None:
        out = original(self)
        guided = isinstance(inductor_config.post_grad_custom_post_pass, DecodeStepPass)
        if guided and out and not self.is_reduction and out[0].startswith("#pragma omp for"):
            out = ["#pragma omp for schedule(guided)" + out[0][len("#pragma omp for"):], *out[1:]]
        return out

    lines._linnet_guided = True  # type: ignore[attr-defined]  # marks the patch, so that it is made once
    LoopLevel.lines = lines  # type: ignore[method-assign]  # patching inductor's class is the point


PREFETCH_BYTES = 4096
STREAMED_BYTES = 2 << 20  # a buffer at least this large is read from memory, not from a cache


def _install_prefetching_loads() -> None:
    from torch._inductor.codegen.cpp import CppVecKernel
    from torch._inductor.codegen.cpp_utils import cexpr_index
    from torch._inductor.virtualized import V

    if getattr(CppVecKernel.load, "_linnet_prefetching", False):
        return
    original = CppVecKernel.load

    def load(self: CppVecKernel, name: str, index: Any) -> Any:
        if isinstance(inductor_config.post_grad_custom_post_pass, DecodeStepPass):
            try:
                dtype, numel = V.graph.get_dtype(name), V.graph.get_numel(name)
            except KeyError:  # a kernel's own local buffer (a per-thread scratch row), not the graph's
                return original(self, name, index)
            sized = isinstance(numel, int) or getattr(numel, "is_number", False)  # not a symbolic size
            if dtype.is_floating_point and sized and int(numel) * dtype.itemsize >= STREAMED_BYTES:
                renamed = self.rename_indexing(index)
                if self._try_get_const_stride(renamed, self.itervars[self.tiling_idx]) == 1:
                    ahead = PREFETCH_BYTES // dtype.itemsize
                    self.loads.writeline(f"__builtin_prefetch({self.args.input(name)} + "
                                         f"{cexpr_index(renamed)} + {ahead});")
        return original(self, name, index)

    load._linnet_prefetching = True  # type: ignore[attr-defined]  # marks the patch, so that it is made once
    CppVecKernel.load = load  # type: ignore[method-assign]  # patching inductor's class is the point
