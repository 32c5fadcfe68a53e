"""``linnet compile MODEL --target T``: print a model's Program, or write a backend's standalone artifact."""
from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from linnet.backends.registry import packages
from linnet.commands._checks import add_force_argument, path
from linnet.commands._common import add_model_argument
from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
from linnet.files import atomic_write, check_output
from linnet.model import open_model, open_spec
from linnet.program import build_program


def writers() -> dict[str, str]:
    """Each backend target and its writer ("module:attribute"), as the packages declare them."""
    return {name: writer for package in packages() for name, writer in package.compile_targets}


def targets() -> list[str]:
    return ["program", *writers()]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("compile", help="print a model's Program, or write a backend's source, weights and loader")
    add_model_argument(parser)
    parser.add_argument("--target", default="torch", choices=targets(),
                        help="a backend: write its artifact to -o DIR (default: torch); "
                             "program: print the step as text")
    parser.add_argument("--dtype", default="f32", choices=tuple(DTYPES))
    parser.add_argument("-o", "--output", type=path, help="directory to write (a backend target); file for the program")
    add_force_argument(parser)
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    if args.output:  # before anything loads: refusing takes no time
        check_output(args.output, args.force)
    if args.target == "program":
        text = str(build_program(open_spec(args.model), args.dtype))
        if args.output:
            atomic_write(args.output, lambda tmp: tmp.write_text(text))
            print(f"wrote {args.output}")
        else:
            print(text, end="")
        return 0
    if not args.output:
        raise LinnetError(f"--target {args.target} writes a directory: give it with -o DIR")
    out = Path(args.output)
    module, _, attribute = writers()[args.target].partition(":")
    writer = getattr(importlib.import_module(module), attribute)
    model = open_model(args.model)
    written: list[str] = []

    def write(tmp: Path) -> None:  # the whole artifact, or (interrupted, failed) nothing
        tmp.mkdir()
        written.extend(writer(model, tmp, args.dtype))

    atomic_write(out, write)
    print(f"wrote {', '.join(f'{out}/{name}' for name in written)}")
    return 0
