"""``linnet models``: the models in the registry (each entry checked; a broken one is an error)."""
from __future__ import annotations

import argparse
import dataclasses
import json

from linnet import registry
from linnet.site.format import parameters


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("models", help="list the models in the registry")
    parser.add_argument("--json", action="store_true", help="print the entries as one JSON list")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    entries = registry.entries()
    if args.json:
        print(json.dumps([dataclasses.asdict(e) for e in entries], indent=1))
        return 0
    table = [("id", "name", "parameters", "architecture", "licence", "checkpoint")]
    table += [(e.id, e.name, parameters(e.parameters), e.architecture, e.licence, e.hf.repo) for e in entries]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0
