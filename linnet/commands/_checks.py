"""Flag types that check a value's range, so that argparse names the flag in the user's words:
``argument --max-new-tokens: must be at least 1, got 0``."""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from linnet.sampling import SEED_MAX


def whole(least: int, most: int | None = None, bound: str = "") -> Callable[[str], int]:
    """An integer of at least ``least`` and, given ``most``, at most ``most`` (``bound`` says what that is)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {_shown(text)}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}{bound}, got {value}")
        return value
    return parse


seed = whole(0, SEED_MAX, " (2^63 - 1)")


# At most the CPUs this process may run on: more only oversubscribes them (999 threads on 2 cores took
# minutes and drove the load average to ~970).
threads = whole(1, len(os.sched_getaffinity(0)), ", the CPUs this process may use")


port = whole(1, 65535)


def text(value: str) -> str:
    """Text that can be encoded: an argument that is not valid UTF-8 reaches Python as lone surrogates
    (``surrogateescape``), which no tokenizer, JSON writer or HTTP header takes."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(value[e.start])
        what = f"byte {code - 0xDC00:#x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate {code:#x}"
        raise argparse.ArgumentTypeError(f"is not valid UTF-8 text: {what} at character {e.start}") from None
    return value


def path(text: str) -> str:
    """A path this system can name: no NUL, and bytes it can encode (an argument that is not UTF-8 arrives as
    surrogates that encode back to its bytes; other surrogates, from a caller in Python, do not)."""
    if "\0" in text:
        raise argparse.ArgumentTypeError("is not a path: it holds a NUL character")
    try:
        os.fsencode(text)
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(f"is not a path: character {e.start} cannot be encoded") from None
    return text


def message(value: str) -> str:
    """Non-empty text: a prompt, a message, a stop string."""
    if not text(value):
        raise argparse.ArgumentTypeError("is empty; give the text")
    return value


def size(text: str) -> int:
    """A size in bytes, whole or with a binary suffix: 4M, 512k, 1G."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    number, unit = (text[:-1], units[text[-1].lower()]) if text[-1:].lower() in units else (text, 1)
    return whole(1)(number) * unit


def _shown(text: str) -> str:
    """``text`` quoted for an error line: what cannot be printed escaped, and at most 40 characters."""
    quoted = ascii(text) if not text.isprintable() else repr(text)
    return quoted if len(quoted) <= 42 else f"{quoted[:40]}..."


def number(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    """A number in ``[low, high]`` (``(low, high]`` when ``low_open``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {_shown(text)}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            shown = text if text.isprintable() else ascii(text)
            raise argparse.ArgumentTypeError(f"must be in {interval}, got {shown}")
        return value
    return parse


def add_force_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help="replace the output if it exists")
