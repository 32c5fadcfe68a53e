"""``linnet compile --target jax``: the generated JAX source with a standalone loader; ``--target stablehlo``:
Linnet's own StableHLO modules with their calling convention. Both over the same stacked weights file."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from linnet.backends.xla.codegen import generate_source
from linnet.backends.xla.layout import stacked_weights, xla_program
from linnet.backends.xla.stablehlo import Sizes, arguments, emit_module, weight_shapes
from linnet.rope import rope_tables

PREFILL_LENGTH = 64  # the StableHLO prefill module's tokens per call (pad shorter prompts; see the convention)

LOADER = '''\\
"""Load the generated JAX model and greedy-decode a few tokens. Standalone: jax, numpy and safetensors.

    python run.py 1 2 3          # prompt token ids; prints the next {new} greedy token ids
"""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from safetensors.numpy import load_file

from model import KV_HEADS, HEAD_DIM, LAYERS, step

HERE = Path(__file__).parent


def load(rows: int = 1, positions: int = {positions}):
    """The step (jitted, caches donated), its weights as the pytree `step` takes (a layer's weights are
    stacked in the file: "layers.qkv" [LAYERS, ...]; one some layers lack is each layer's own:
    "layers.0.expert_gate"), the rotary tables and an empty KV cache."""
    stored = load_file(HERE / "weights.safetensors")
    weights = {{name: jnp.asarray(a) for name, a in stored.items() if not name.startswith("layers.")}}
    weights["layers"] = [{{}} for _ in range(LAYERS)]
    for name, a in stored.items():
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "layers":
            weights["layers"][int(parts[1])][parts[2]] = jnp.asarray(a)
        elif parts[0] == "layers":
            for i, layer in enumerate(weights["layers"]):
                layer[parts[1]] = jnp.asarray(a[i])
    rope = load_file(HERE / "rope.safetensors")  # float32 [positions, ROTARY_DIM]
    shape, dtype = (rows, KV_HEADS, positions, HEAD_DIM), weights["embed"].dtype
    caches = [[jnp.zeros(shape, dtype) for _ in range(LAYERS)] for _ in "kv"]
    jitted = jax.jit(step, donate_argnames=("cache_k", "cache_v"))
    return jitted, weights, (rope["cos"][:positions], rope["sin"][:positions]), *caches


if __name__ == "__main__":
    step, weights, (cos, sin), cache_k, cache_v = load()
    prompt = [int(t) for t in sys.argv[1:]] or [1]
    tokens, positions = jnp.array([prompt]), jnp.arange(len(prompt))[None]
    out = []
    for _ in range({new}):
        select = jnp.array([[tokens.shape[1] - 1]])
        logits, cache_k, cache_v = step(weights, cache_k, cache_v, cos, sin, tokens, positions, jnp.array([0]), select)
        out.append(int(logits[0, 0].argmax()))
        tokens, positions = jnp.array([[out[-1]]]), positions[:, -1:] + 1
    print(*out)
'''


def write_jax(model: Any, out: Path, dtype: str) -> list[str]:
    program = xla_program(model.spec, dtype)
    (out / "model.py").write_text(generate_source(program))
    (out / "run.py").write_text(LOADER.format(positions=_positions(model.spec), new=8))
    return ["model.py", *_write_weights(model, program, out, dtype), "run.py"]


def write_stablehlo(model: Any, out: Path, dtype: str) -> list[str]:
    program = xla_program(model.spec, dtype)
    positions = _positions(model.spec)
    modules = {"decode": Sizes(1, 1, 1, 1, positions), "prefill": Sizes(1, PREFILL_LENGTH, 1, 1, positions)}
    for name, sizes in modules.items():
        (out / f"{name}.mlir").write_text(emit_module(program, sizes, name))
    convention = calling_convention(program, modules)
    (out / "calling_convention.json").write_text(json.dumps(convention, indent=1) + "\n")
    return [*(f"{name}.mlir" for name in modules), "calling_convention.json",
            *_write_weights(model, program, out, dtype)]


def _positions(spec: Any) -> int:
    return min(256, spec.max_positions)


def _write_weights(model: Any, program: Any, out: Path, dtype: str) -> list[str]:
    save_file({name: np.ascontiguousarray(a) for name, a in stacked_weights(model.weights, program).items()},
              str(out / "weights.safetensors"))
    cos, sin = rope_tables(model.spec, model.spec.max_positions)
    save_file({"cos": cos, "sin": sin}, str(out / "rope.safetensors"))
    return [f"weights.safetensors ({dtype})", "rope.safetensors"]


def calling_convention(program: Any, modules: dict[str, Sizes]) -> dict[str, Any]:
    """What each module's ``main`` takes and returns, and where each weight argument is in the files."""
    holders = Counter(name.split(".", 2)[2] for name, _ in weight_shapes(program) if name.startswith("layers."))

    def source(name: str) -> dict[str, Any]:
        if name.startswith("layers."):
            _, index, part = name.split(".", 2)
            if holders[part] < program.spec.num_layers:  # a weight some layers lack: each layer's own tensor
                return {"file": "weights.safetensors", "tensor": name}
            return {"file": "weights.safetensors", "tensor": f"layers.{part}", "index": int(index)}
        if name.startswith("rope_"):
            return {"file": "rope.safetensors", "tensor": name.removeprefix("rope_"), "rows": "the first P"}
        return {"file": "weights.safetensors", "tensor": name}

    inputs = {"tokens", "positions", "rows", "select"}
    return {
        "entry_point": "main",
        "about": "Arguments in order. Integer inputs are i32: tokens, positions [R, T] (positions < P; a padding "
                 "token writes position P - 1, which no real query reads), rows [R] (distinct), select [R, S] "
                 "(indices into T). cache_k.<i>, cache_v.<i> start as zeros and are donated: results 1.. alias "
                 "them in argument order and are the next call's caches. Result 0: logits [R, S, vocab] f32. "
                 "A weight's source 'index' is its layer along the stacked tensor's first axis (a weight some "
                 "layers lack is a tensor of each layer's own).",
        "modules": {
            name: {
                "file": f"{name}.mlir", "sizes": asdict(sizes),
                "arguments": [{"name": n, "shape": list(shape), "dtype": dtype,
                               **({} if n in inputs or n.startswith("cache_") else {"source": source(n)})}
                              for n, shape, dtype in arguments(program, sizes)],
            }
            for name, sizes in modules.items()
        },
    }
