"""A backend's weight plan carried out on NumPy arrays, once per model and plan, then mapped from disk.

The plan (fusions and folds, as ``linnet.program`` records them, and the run dtype) is applied to the
checkpoint's arrays; the result is kept in the converted-weights cache, keyed by the weights' source, the
plan, and the source text of this module, so that a change to either never reuses an old conversion.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from linnet import quantize
from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
from linnet.weight_cache import cached_arrays, code_identity
from linnet.weights import Weights

if TYPE_CHECKING:
    from linnet.program import Program

SECTIONS = ("layer", "head")


@dataclass(frozen=True)
class WeightPlan:
    dtype: str  # "f32" | "f16" | "bf16": the run dtype, every array's in the result
    # (new name, parts): per layer, layers.{i}.<parts> concatenated along axis 0 into layers.{i}.<new name>
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # (section, weight, norm): weight[:, j] *= norm[j] in float32, rounded once to dtype; the norm is removed.
    # Section "layer": names within each layer; "head": global names.
    folded: tuple[tuple[str, str, str], ...] = ()
    # (section, weight, form): stored last as ``form``'s block bytes (``linnet.quantize``). A weight whose
    # source tensors (``weights.blocks``, a GGUF file's) are in that form already, and which is not
    # folded, is their bytes as they are (concatenated, when fused), never dequantised and requantised.
    quantized: tuple[tuple[str, str, str], ...] = ()

    @classmethod
    def of(cls, program: Program) -> WeightPlan:
        """The plan a program records: its weight dtype, fusions, folds and quantised matrices."""
        return cls(program.weight_dtype, program.fused, program.folded, program.quantized)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise LinnetError(f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        for _, _, form in self.quantized:
            quantize.check_form(form, forms=tuple(quantize.FORMS))
        for section, _, _ in (*self.folded, *self.quantized):
            if section not in SECTIONS:
                raise LinnetError(f"unknown weight-plan section {section!r}; expected one of {SECTIONS}")


def plan_weights(weights: Weights, plan: WeightPlan) -> dict[str, np.ndarray]:
    """``weights`` laid out as ``plan`` says, C-contiguous: fusions first, then folds, then the cast, then
    quantisation (a quantised weight is uint8 block bytes). Mapped read-only from the cache when this
    source was converted by this plan and code before."""
    key = f"{plan!r} by {code_identity(sys.modules[__name__], quantize)}"
    arrays = cached_arrays(weights.source, key, lambda: _apply(weights, plan))
    stored = quantize.block_names(plan.quantized, weights.spec.num_layers)
    return {name: quantize.from_storage(a) if name in stored else a for name, a in arrays.items()}


def _apply(weights: Weights, plan: WeightPlan) -> Iterator[tuple[str, np.ndarray]]:
    """The converted arrays as (name, array) pairs, each made when asked for: the cache writes each as it
    comes, so that a conversion holds one converted array at a time, not the model twice."""
    layers = [f"layers.{i}." for i in range(weights.spec.num_layers)]
    wanted = quantize.block_names(plan.quantized, weights.spec.num_layers)
    parts_of = {prefix + name: [prefix + p for p in parts] for prefix in layers for name, parts in plan.fused}
    folded = {prefix + name for section, name, _ in plan.folded for prefix in (layers if section == "layer" else [""])}
    blocks = getattr(weights, "blocks", {})  # name -> (form, block bytes): tensors a file stores quantised
    native = {name for name, form in wanted.items() if name not in folded
              and all(blocks.get(p, ("",))[0] == form for p in parts_of.get(name, [name]))}
    taken = {p for name in native for p in parts_of.get(name, [name])}
    # what each array is made from: the others are read as floats when their turn comes
    makers: dict[str, Callable[[], np.ndarray]] = {
        name: partial(weights.__getitem__, name) for name in weights if name not in taken}
    # A layer whose kind lacks a weight (an MoE model's sparse layers have no dense gate and up) is left out.
    for prefix in layers:
        for name, parts in plan.fused:
            if prefix + name not in native and all(prefix + p in makers for p in parts):
                made = [makers.pop(prefix + p) for p in parts]
                makers[prefix + name] = partial(lambda made: np.concatenate([m() for m in made]), made)
    for section, name, norm in plan.folded:
        for prefix in layers if section == "layer" else [""]:
            if prefix + name not in makers:
                continue
            weight, norm_weight = makers[prefix + name], makers.pop(prefix + norm)
            makers[prefix + name] = partial(
                lambda w, n: w().astype(np.float32) * n().astype(np.float32), weight, norm_weight)
    target = DTYPES[plan.dtype].numpy
    for name, make in makers.items():
        if name not in wanted:
            yield name, np.ascontiguousarray(make().astype(target, copy=False))
    for name, form in wanted.items():
        if name in native:
            yield name, quantize.to_storage(np.concatenate([blocks[p][1] for p in parts_of.get(name, [name])]))
        else:
            yield name, quantize.to_storage(quantize.quantized(makers[name](), form))
