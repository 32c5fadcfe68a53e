"""``linnet compile MODEL --target T``: print a model's Program, or write a backend's standalone artifact."""
from __future__ import annotations

import argparse
from pathlib import Path

from linnet.backends.registry import packages
from linnet.commands._common import add_model_argument
from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
from linnet.model import open_model, open_spec
from linnet.program import build_program


def targets() -> list[str]:
    return ["program", *(p.name for p in packages() if p.compile_target)]


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("compile", help="print a model's Program, or write a backend's source, weights and loader")
    add_model_argument(parser)
    parser.add_argument("--target", default="torch", choices=targets(),
                        help="a backend: write its artifact to -o DIR (default: torch); program: print the step as text")
    parser.add_argument("--dtype", default="f32", choices=tuple(DTYPES))
    parser.add_argument("-o", "--output", help="directory to write (a backend target); file for the program")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    if args.target == "program":
        text = str(build_program(open_spec(args.model), args.dtype))
        if args.output:
            Path(args.output).write_text(text)
            print(f"wrote {args.output}")
        else:
            print(text, end="")
        return 0
    if not args.output:
        raise LinnetError(f"--target {args.target} writes a directory: give it with -o DIR")
    out = Path(args.output)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LinnetError(f"cannot create {out}: {e.strerror}") from None
    package = next(p for p in packages() if p.name == args.target)
    written = package.write(open_model(args.model), out, args.dtype)
    print(f"wrote {', '.join(f'{out}/{name}' for name in written)}")
    return 0
