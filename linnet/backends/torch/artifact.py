"""``linnet compile --target torch``: the generated source, its weights and a standalone loader."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from linnet.backends.torch.codegen import generate_source
from linnet.backends.torch.runner import torch_program, torch_weights
from linnet.rope import rope_tables

LOADER = '''\\
"""Load the generated model and greedy-decode a few tokens. Standalone: torch and safetensors only.

    python run.py 1 2 3          # prompt token ids; prints the next {new} greedy token ids
"""
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from model import Model

HERE = Path(__file__).parent


def load(rows: int = 1, positions: int = {positions}) -> Model:
    weights = load_file(HERE / "weights.safetensors")
    rope = load_file(HERE / "rope.safetensors")  # float32 [positions, rotary dims] tables
    cos, sin = rope["cos"][:positions], rope["sin"][:positions]
    return Model(weights, cos, sin, rows, weights["embed"].dtype)


if __name__ == "__main__":
    model, prompt = load(), [int(t) for t in sys.argv[1:]] or [1]
    rows = torch.tensor([0])
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), torch.arange(len(prompt))[None], rows)
        out = []
        for step in range({new}):
            out.append(int(logits[0, -1].argmax()))
            logits = model(torch.tensor([[out[-1]]]), torch.tensor([[len(prompt) + step]]), rows)
    print(*out)
'''


def write(model: Any, out: Path, dtype: str) -> list[str]:
    program = torch_program(model.spec, dtype)
    (out / "model.py").write_text(generate_source(program))
    save_file({name: t.contiguous() for name, t in torch_weights(model.weights, program).items()},
              out / "weights.safetensors")
    cos, sin = rope_tables(model.spec, model.spec.max_positions)
    save_file({"cos": torch.from_numpy(cos), "sin": torch.from_numpy(sin)}, out / "rope.safetensors")
    (out / "run.py").write_text(LOADER.format(positions=min(256, model.spec.max_positions), new=8))
    return ["model.py", f"weights.safetensors ({dtype})", "rope.safetensors", "run.py"]
