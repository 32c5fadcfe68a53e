"""What every fuzz target checks, and the settings it runs under.

A reader of outside input must end in a result or in one ``LinnetError`` whose message is one line and
names the file (``where``); any other exception fails the example, and Hypothesis shrinks it to the
smallest input that does. ``FAST`` runs in the default suite (a fixed seed, a few seconds a target);
``LONG`` in the slow tier.
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linnet.errors import LinnetError

REGRESSIONS = Path(__file__).parent / "regressions"

_COMMON = dict(derandomize=True, database=None, deadline=timedelta(seconds=10),
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                      HealthCheck.data_too_large])
FAST = settings(max_examples=200, **_COMMON)
LONG = settings(max_examples=2000, **_COMMON)


def clean(read: Callable[[], Any], where: str | Path) -> Any:
    """``read()``'s result, or None when it refused the input with a one-line LinnetError naming ``where``."""
    try:
        return read()
    except LinnetError as e:
        message = str(e)
        assert "\n" not in message, message
        assert str(where) in message or Path(where).name in message, f"{where} not named in: {message}"
        return None


def fast_and_long(check: Callable[..., None]) -> tuple[Callable[..., None], Callable[..., None]]:
    """``check(..., data)`` as two tests: bounded for the default suite, longer (marked slow) for CI's slow
    tier; ``data`` draws the input."""
    return FAST(given(data=st.data())(check)), pytest.mark.slow(LONG(given(data=st.data())(check)))


# -- input shapes -------------------------------------------------------------------------------------
INTERESTING_INTS = [0, 1, 2, 3, 4, 7, 8, 255, 2**31 - 1, 2**32 - 1, 2**32, 2**60, 2**63 - 1, 2**64 - 1]


@st.composite
def mutated(draw: st.DrawFn, data: bytes, focus: int | None = None) -> bytes:
    """``data`` with a few edits inside its first ``focus`` bytes (the header): bytes flipped, little-endian
    integers overwritten with values that break sizes, a span deleted or repeated, or the end cut off."""
    out = bytearray(data)
    limit = min(len(out), focus or len(out))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.randoms(use_true_random=False)).randrange(max(limit, 1))  # uniform over the header
        kind = draw(st.sampled_from(["byte"] * 3 + ["int"] * 3 + ["delete", "repeat", "truncate"]))
        if kind == "byte":
            out[at:at + 1] = bytes([draw(st.integers(0, 255))])
        elif kind == "int":
            width = draw(st.sampled_from([4, 8]))
            value = draw(st.sampled_from(INTERESTING_INTS)) % 2 ** (8 * width)
            out[at:at + width] = value.to_bytes(width, "little")
        elif kind == "delete":
            del out[at:at + draw(st.integers(1, 64))]
        elif kind == "repeat":
            out[at:at] = out[at:at + draw(st.integers(1, 64))]
        else:
            del out[at:]
    return bytes(out)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def edited(draw: st.DrawFn, data: dict[str, Any], values: st.SearchStrategy = JSON) -> dict[str, Any]:
    """``data`` (a JSON object) with some keys given other values of any JSON type, or removed."""
    out = dict(data)
    keys = sorted(out)
    for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=4)):
        if draw(st.booleans()):
            out[key] = draw(values)
        else:
            out.pop(key, None)
    return out
