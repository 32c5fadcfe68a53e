"""``linnet info MODEL``: the model's spec, as Linnet reads it."""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from linnet.backends.runner import Runner
from linnet.commands._common import add_model_argument
from linnet.gguf.format import GGUFFile
from linnet.model import open_model
from linnet.program import build_program
from linnet.program.rings import ring_caches


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("info", help="print a model's spec")
    add_model_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    model = open_model(args.model)
    spec = model.spec
    # keys and values of one cache row at the model's whole context, in its own dtype: sliding layers keep
    # rings of their window and the runners' default prompt chunk (linnet.program.rings)
    positions = spec.max_positions
    program = ring_caches(build_program(spec, spec.dtype), positions, Runner.prefill_chunk, positions)
    info = {"path": str(model.path), "quantisation": quantisation(model.path), **spec.to_dict(),
            "parameters": spec.parameter_count(),
            # a mixture of experts reads top_k of its experts per token
            **({"active_parameters": spec.active_parameter_count()} if spec.moe is not None else {}),
            "kv_cache_bytes_per_row": program.cache_bytes_per_row(positions)}
    if model.tokenizer is not None:
        info["tokenizer_eos_ids"] = list(model.tokenizer.eos_ids)
        info["chat_template"] = model.tokenizer.chat_template is not None
    if args.json:
        print(json.dumps(info))
        return 0
    width = max(map(len, info))
    for key, value in info.items():
        if key == "quantisation":
            value = ", ".join(f"{k} ({n} tensor{'s' * (n != 1)})" for k, n in value.items()) if value else "none"
        print(f"{key:<{width}}  {value}")
    return 0


def quantisation(path: Path) -> dict[str, int] | None:
    """A GGUF file's tensor types and how many tensors each, the most common first (``dtype`` is what the
    weights are computed in once dequantised); None for a checkpoint of plain floats."""
    if path.suffix != ".gguf":
        return None
    kinds = Counter(info.type.name for info in GGUFFile(path).tensors.values())
    return dict(kinds.most_common())
