"""The ``linnet`` command. Each subcommand lives in ``linnet/commands/<name>.py`` with a ``register``."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# Before torch loads OpenMP: waiting threads sleep instead of spinning. On 2 busy cores spinning made
# decoding 2-4x slower; on a quiet machine the policies measured within noise (docs/BENCH.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
