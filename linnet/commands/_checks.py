"""Flag types that check a value's range, so that argparse names the flag in the user's words:
``argument --max-new-tokens: must be at least 1, got 0``."""
from __future__ import annotations

import argparse
from collections.abc import Callable


def whole(least: int) -> Callable[[str], int]:
    """An integer of at least ``least``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value
    return parse


def number(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    """A number in ``[low, high]`` (``(low, high]`` when ``low_open``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (low < value if low_open else low <= value) or not value <= high:
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be in {interval}, got {text}")
        return value
    return parse


def add_force_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help="replace the output if it exists")
