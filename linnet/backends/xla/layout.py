"""The XLA backends' program and weight layout: each layer's weights stacked along a first axis of LAYERS
on disk (one file, one array per name), and handed to the generated step layer by layer.

On one device the program fuses q/k/v and gate/up and folds the norms' weights into the matrices (as
torch's); sharded over several devices it keeps every projection apart, so that splitting a matrix's
rows (or columns) over the devices splits whole heads, and no product's output needs regrouping.
"""
from __future__ import annotations

import sys

import numpy as np

from linnet.program import Program, build_program, fold_norm_weights, fuse_norm_linears, fuse_projections
from linnet.spec import ModelSpec
from linnet.weight_cache import cached_arrays, code_identity
from linnet.weight_plan import WeightPlan, plan_weights
from linnet.weights import Weights


def xla_program(spec: ModelSpec, dtype: str = "f32", sharded: bool = False) -> Program:
    program = build_program(spec, dtype)
    return program if sharded else fold_norm_weights(fuse_norm_linears(fuse_projections(program)))


def stacked_weights(weights: Weights, program: Program, settle: bool = True) -> dict[str, np.ndarray]:
    """Flat names (``embed``, ``layers.qkv`` [LAYERS, ...]) in the program's layout and dtype, converted
    once and then mapped from the converted-weights cache (read ahead unless ``settle`` is False)."""
    plan = WeightPlan.of(program)
    layers = weights.spec.num_layers

    def build() -> dict[str, np.ndarray]:
        arrays = plan_weights(weights, plan)
        out = {name: a for name, a in arrays.items() if not name.startswith("layers.")}
        for name in {n.split(".", 2)[2] for n in arrays if n.startswith("layers.")}:
            parts = {i: arrays[f"layers.{i}.{name}"] for i in range(layers) if f"layers.{i}.{name}" in arrays}
            if len(parts) == layers:
                out[f"layers.{name}"] = np.stack(list(parts.values()))
            else:  # a weight some layers lack (dense layers among sparse ones): kept per layer
                out.update({f"layers.{i}.{name}": a for i, a in parts.items()})
        return out

    key = f"stacked {plan!r} by {code_identity(sys.modules[__name__])}"
    return cached_arrays(weights.source, key, build, settle)


def as_tree(flat: dict[str, np.ndarray], layers: int) -> dict[str, object]:
    """``{"embed": .., "layers": [{"qkv": ..}, ..]}``: the pytree the generated ``step`` takes, each
    layer's weights a view of its part of the stacked arrays (or its own, ``layers.<i>.<name>``)."""
    tree: dict[str, object] = {name: a for name, a in flat.items() if not name.startswith("layers.")}
    per_layer: list[dict[str, np.ndarray]] = [{} for _ in range(layers)]
    for name, a in flat.items():
        index, _, own = name.removeprefix("layers.").partition(".")
        if not name.startswith("layers."):
            continue
        if index.isdigit():
            per_layer[int(index)][own] = a
        else:
            for i in range(layers):
                per_layer[i][index] = a[i]
    tree["layers"] = per_layer
    return tree
