"""``linnet info MODEL``: the model's spec, as Linnet reads it."""
from __future__ import annotations

import argparse
import json

from linnet.commands._common import add_model_argument
from linnet.model import open_model
from linnet.program import build_program


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("info", help="print a model's spec")
    add_model_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    model = open_model(args.model)
    spec = model.spec
    info = {"path": str(model.path), **spec.to_dict(), "parameters": spec.parameter_count(),
            # keys and values of one cache row at the model's whole context, in its own dtype
            "kv_cache_bytes_per_row": build_program(spec, spec.dtype).cache_bytes_per_row(spec.max_positions)}
    if model.tokenizer is not None:
        info["tokenizer_eos_ids"] = list(model.tokenizer.eos_ids)
        info["chat_template"] = model.tokenizer.chat_template is not None
    if args.json:
        print(json.dumps(info))
        return 0
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0
