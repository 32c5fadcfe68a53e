"""The ``linnet`` command. Each subcommand lives in ``linnet/commands/<name>.py`` with a ``register``."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from linnet.openmp import set_default_policy

set_default_policy(os.environ)  # before torch loads OpenMP: waiting threads spin briefly, then sleep

from linnet.errors import LinnetError

COMMANDS = ("run", "info", "compile", "bench", "export", "models", "site")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="linnet", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"linnet.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except LinnetError as e:
        print(f"linnet: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
