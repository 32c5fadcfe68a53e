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
- A prefetch ahead of each stream, in AVX2 code: every contiguous vector load of floating-point values
  from a buffer larger than the L2 cache (a weight matrix, a layer's KV cache) is preceded by a software
  prefetch `PREFETCH_BYTES` further on. On an AVX2 EPYC the CPU's own prefetchers left a one-row loop
  over bf16 weights at 70-80% of what a plain sum of memory reads; 2-8 KB ahead it read as fast as the
  sum. On an AVX-512 EPYC the same prefetches slowed that loop by a sixth and the decode step by a
  ninth, so code for 512-bit vectors has none (docs/NOTEBOOK.md, 2026-12-07). Not for the integer codes of a matrix in
  blocks: those loops are bound by their arithmetic, and the prefetches slowed SmolLM2's Q4_1 decode by
  a fifth. A prefetch never faults, so one past a buffer's end is harmless. Wrapped the same way, in
  the same compiles.
- bf16 dot products where the CPU has them (AVX512-BF16): a sum over the vector axis of a bf16 weight
  times a bf16 input, each widened to f32 in the loop, is one `vdpbf16ps` a 32 values instead of two
  widenings and two multiply-adds. The products of two bf16 values are exact in f32, so only the order
  of the f32 sums changes. Widening cost that loop up to a quarter of its speed once memory was fast
  enough to outrun it (docs/NOTEBOOK.md, 2026-12-07). So that the input is bf16 in the loop, a product's input
  rounded to 16 bits is realized in 16 bits (`product_inputs`).

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
                # through views; and through the widening of an input rounded to 16 bits, which is
                # realized in 16 bits (the rounding done once, not again for every weight row)
                activation = _through(activation, _VIEWS)
                if _widens_16_bits(activation):
                    activation = _through(activation.args[0], _VIEWS)
                if (_from_memory(weight) and _is_pointwise(activation) and not _from_memory(activation)
                        and activation not in found):
                    found.append(activation)
    return found


def _widens_16_bits(node: Any) -> bool:
    """Whether a node casts a 16-bit floating-point value to float32."""
    if not (isinstance(node, torch.fx.Node) and node.target in _CASTS and isinstance(node.args[0], torch.fx.Node)):
        return False
    source, result = node.args[0].meta.get("val"), node.meta.get("val")
    return (getattr(source, "dtype", None) in (torch.bfloat16, torch.float16)
            and getattr(result, "dtype", None) == torch.float32)


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
        return "linnet-decode-step-9"


DECODE_STEP_PASS = DecodeStepPass()


def decode_compile_options() -> dict[str, Any]:
    """torch.compile options for the decode step (installing the guided-loop wrapper once per process)."""
    _install_guided_loops()
    _install_prefetching_loads()
    _install_bf16_dot_products()
    return {
        "realize_reads_threshold": 1,
        "post_grad_custom_post_pass": DECODE_STEP_PASS,
        "cpp.enable_floating_point_contract_flag": "fast",
        # keep the roundings the generated code asks for (16-bit products' inputs and results, see its
        # `linear`), which inductor would otherwise drop inside a fused loop
        "emulate_precision_casts": True,
    }


def _compiling_a_decode_step() -> bool:
    """Whether inductor is compiling with these options (the wrapped code generators act only then)."""
    return isinstance(inductor_config.post_grad_custom_post_pass, DecodeStepPass)


def _install_guided_loops() -> None:
    from torch._inductor.codegen.cpp import LoopLevel

    if getattr(LoopLevel.lines, "_linnet_guided", False):
        return
    original = LoopLevel.lines

    def lines(self: LoopLevel) -> list[str] | None:
        out = original(self)
        guided = _compiling_a_decode_step()
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
        if _compiling_a_decode_step() and self.vec_isa.bit_width() == 256:
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


def _install_bf16_dot_products() -> None:
    from torch._inductor.codegen.cpp import CppVecKernel
    from torch._inductor.codegen.cpp_utils import CppCSEVariable

    if getattr(CppVecKernel.reduction_combine_vec, "_linnet_bf16_dot", False):
        return
    original_update, original_combine = CppCSEVariable.update_on_args, CppVecKernel.reduction_combine_vec

    def update_on_args(self: CppCSEVariable, name: str, args: Any, kwargs: Any) -> None:
        # what each value of a kernel is, as far as the rewrite below needs: a bf16 load, its widening
        # to f32, and the product of two such widenings
        original_update(self, name, args, kwargs)
        if name == "load" and self.dtype == torch.bfloat16:
            self._linnet_bf16 = True  # type: ignore[attr-defined]
        elif name in ("to_dtype", "identity") and getattr(args[0], "_linnet_bf16", False):
            if self.dtype == torch.bfloat16:  # the same values: `(tmp)`
                self._linnet_bf16 = True  # type: ignore[attr-defined]
            elif self.dtype == torch.float32:
                self._linnet_widened = args[0]  # type: ignore[attr-defined]
        elif name == "mul" and all(getattr(a, "_linnet_widened", None) is not None for a in args):
            self._linnet_bf16_pair = tuple(a._linnet_widened for a in args)  # type: ignore[attr-defined]

    def reduction_combine_vec(self: CppVecKernel, reduction_type: str, var: str, next_value: Any,
                              helper_val: Any = None, index: Any = None, horizontal_reduction: Any = None,
                              src_dtype: Any = torch.float32) -> str:
        pair = getattr(next_value, "_linnet_bf16_pair", None)
        # only a sum along the vector axis (its lanes are added up at the end, so which lane holds which
        # pair does not matter), whole vectors of 32 bf16 values (one 512-bit register each), in
        # decode-step compiles for a CPU with bf16 dot products
        if (pair is not None and reduction_type == "sum" and helper_val is None and not self.tail_size
                and horizontal_reduction and self.tiling_factor == 32 and all(v.is_vec for v in pair)
                and getattr(self.vec_isa, "is_avx512_bf16_supported", lambda: False)()
                and _compiling_a_decode_step()):
            a, b = pair
            return (f"[&] {{ auto sums = {var}; sums[0] = at::vec::Vectorized<float>(_mm512_dpbf16_ps(sums[0], "
                    f"(__m512bh)(__m512i){a}, (__m512bh)(__m512i){b})); return sums; }}()")
        return original_combine(self, reduction_type, var, next_value, helper_val, index, horizontal_reduction,
                                src_dtype)

    reduction_combine_vec._linnet_bf16_dot = True  # type: ignore[attr-defined]  # marks the patch, made once
    CppCSEVariable.update_on_args = update_on_args  # type: ignore[method-assign]  # patching inductor is the point
    CppVecKernel.reduction_combine_vec = reduction_combine_vec  # type: ignore[method-assign]
