"""``linnet compile MODEL --target torch -o DIR``: write the generated source, its weights and a loader."""
from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import save_file

from linnet.backends.torch.codegen import generate_source
from linnet.backends.torch.runner import prepare_weights, torch_program
from linnet.commands._common import add_model_argument
from linnet.errors import LinnetError
from linnet.model import open_model
from linnet.spec import DTYPES

LOADER = '''\
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
    return Model(weights, rows, positions, weights["embed"].dtype)


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


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("compile", help="write a model's generated source, weights and loader")
    add_model_argument(parser)
    parser.add_argument("--target", default="torch", choices=["torch"])
    parser.add_argument("--dtype", default="f32", choices=DTYPES)
    parser.add_argument("-o", "--output", required=True, help="directory to write")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    model = open_model(args.model)
    out = Path(args.output)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LinnetError(f"cannot create {out}: {e.strerror}") from None
    program = torch_program(model.spec)
    (out / "model.py").write_text(generate_source(program))
    save_file(prepare_weights(model.weights, program, args.dtype), out / "weights.safetensors")
    (out / "run.py").write_text(LOADER.format(positions=256, new=8))
    print(f"wrote {out}/model.py, {out}/weights.safetensors ({args.dtype}) and {out}/run.py")
    return 0
