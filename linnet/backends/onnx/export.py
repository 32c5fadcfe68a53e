"""ONNX files of a model's step: graphs with their weights as external data, and ``linnet compile --target onnx``.

Weights live in one ``weights.bin`` beside the graphs, each tensor at a 4 KiB-aligned offset (ONNX
Runtime maps aligned external data instead of reading it), so a graph file stays small whatever the
model's size and models past protobuf's 2 GB limit work. The plain and the ONNX Runtime graph share
that one file.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from numpy.typing import DTypeLike

from linnet.backends.onnx.blocks import STACK_FORMS, onnx_parts, stack_parts
from linnet.backends.onnx.contrib import with_interleaved
from linnet.backends.onnx.graph import INTERLEAVED, GraphOptions, build_graph
from linnet.program import Program, block_forms, build_program, fuse_projections, quantize_weights
from linnet.quantize import FORMS, block_names
from linnet.spec import ModelSpec
from linnet.weight_plan import WeightPlan, plan_weights

DATA = "weights.bin"
ALIGN = 4096
GRAPHS = {"plain": "model.onnx", "ort": "model.ort.onnx"}


def onnx_program(spec: ModelSpec, dtype: str, weights: Any = None, quantize: str = "none") -> Program:
    """The Program with q/k/v and gate/up fused: fewer, larger products (norms stay ops of their own);
    ``quantize`` puts matrices in llama.cpp's blocks (``linnet.program.block_forms``), multiplied with
    int8 activations as llama.cpp does: ONNX Runtime's products of float activations and blocks are
    4x slower than its float32 products, those of int8 activations 2.6x faster (docs/ONNX.md)."""
    program = fuse_projections(build_program(spec, dtype))
    forms = block_forms(program, weights, quantize, runs=tuple(FORMS), stacks=STACK_FORMS)  # a file's forms
    return quantize_weights(program, forms, int8_activations=True) if forms else program


def planned_arrays(weights: Any, program: Program, float_type: DTypeLike = np.float32) -> dict[str, np.ndarray]:
    """The weight plan's arrays; a matrix in blocks as MatMulNBits' parts (``name.codes``, ``name.scales``
    ..., ``blocks.onnx_parts``), their scales in ``float_type``; the experts' gate and up interleaved, for
    ONNX Runtime's MoE (``graph.INTERLEAVED``), a stack in blocks as QMoE's parts (``blocks.stack_parts``)."""
    arrays = dict(plan_weights(weights, WeightPlan.of(program)))
    blocks = with_interleaved(block_names(program.quantized, program.spec.num_layers))
    for i in range(program.spec.num_layers):
        for name, (gate, up) in INTERLEAVED.items():
            if f"layers.{i}.{gate}" in arrays:  # [E, F, ...] twice -> [E, 2F, ...]: floats, or rows of blocks
                pair = [arrays[f"layers.{i}.{part}"] for part in (gate, up)]
                arrays[f"layers.{i}.{name}"] = np.stack(pair, axis=2).reshape(pair[0].shape[0], -1, *pair[0].shape[2:])
    out = {}
    for name, array in arrays.items():
        if name not in blocks:
            parts = {"": array}
        else:
            parts = (stack_parts if array.ndim == 3 else onnx_parts)(array, blocks[name], float_type)
        out.update({f"{name}.{part}" if part else name: value for part, value in parts.items()})
    return out


def write_weights(arrays: Mapping[str, np.ndarray], path: Path) -> dict[str, tuple[int, int]]:
    """Every array into one file at aligned offsets; (offset, length) by name."""
    places = {}
    with open(path, "wb") as f:
        for name, array in arrays.items():
            offset = -(-f.tell() // ALIGN) * ALIGN
            f.seek(offset)
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)  # bfloat16 too
            places[name] = (offset, array.nbytes)
    return places


def attach(model: onnx.ModelProto, weights: Mapping[str, str], places: Mapping[str, tuple[int, int]]) -> None:
    """Point each declared weight initializer at its place in ``weights.bin``."""
    for tensor in model.graph.initializer:
        if tensor.name in weights:
            offset, length = places[weights[tensor.name]]
            del tensor.external_data[:]
            for key, value in (("location", DATA), ("offset", str(offset)), ("length", str(length))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value


def write_graphs(program: Program, arrays: Mapping[str, np.ndarray], out: Path, rope_positions: int,
                 variants: Mapping[str, GraphOptions]) -> list[str]:
    """``weights.bin`` and one graph file per variant (``{file name: options}``) under ``out``."""
    shapes = {name: tuple(a.shape) for name, a in arrays.items()}
    built = {file: build_graph(program, shapes, rope_positions, options) for file, options in variants.items()}
    used = sorted({plan for _, weights in built.values() for plan in weights.values()})
    places = write_weights({name: arrays[name] for name in used}, out / DATA)
    for file, (model, weights) in built.items():
        attach(model, weights, places)
        onnx.save_model(model, out / file)
    return [*variants, DATA]


def write(model: Any, out: Path, dtype: str) -> list[str]:
    """``linnet compile --target onnx``: the plain graph, the ONNX Runtime graph, and their weights."""
    program = onnx_program(model.spec, dtype)
    arrays = planned_arrays(model.weights, program)
    variants = {GRAPHS[v]: GraphOptions(variant=v) for v in GRAPHS}
    written = write_graphs(program, arrays, out, model.spec.max_positions, variants)
    return [f"{written[0]} (plain ONNX, opset 18)", f"{written[1]} (ONNX Runtime contrib ops)",
            f"{written[2]} ({dtype} weights, external data)"]
