"""How numbers read on the pages: three figures, thousands separators, "1.84×", "−27.9%".

Rounding is half-up on the decimal digits a reader sees (0.3125 -> "0.313"), not on binary floats.
"""
from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

from linnet.registry.schema import Protocol
from linnet.results import Results, Row

MINUS = "\u2212"  # a real minus sign, as typeset, not a hyphen
DASH = "\u2013"  # an empty cell

UNITS = {"ttft_ms": "ms", "decode_tok_s": "tok/s", "serve_tok_s": "tok/s", "serve_ttft_ms": "ms",
         "load_s": "s", "peak_mem_gib": "GiB"}
TITLES = {"ttft_ms": "Time to first token", "decode_tok_s": "Decode speed",
          "serve_tok_s": "Serving throughput", "serve_ttft_ms": "Serving time to first token",
          "load_s": "Load time", "peak_mem_gib": "Peak GPU memory"}


def _round(value: float, places: int) -> Decimal:
    return Decimal(repr(value)).quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP)


def figure(value: float) -> str:
    """Three figures below 100 ("7.64", "0.42", "50.0", "10.0"), whole numbers above ("8,196")."""
    for places, limit in ((2, 10), (1, 100)):
        rounded = _round(value, places)
        if abs(rounded) < limit:  # checked after rounding, so 9.997 reads "10.0", not "10.00"
            return f"{rounded:,f}"
    return f"{_round(value, 0):,f}"


def metric(value: float, key: str) -> str:
    return f"{figure(value)} {UNITS[key]}"


def significant(value: float, digits: int = 3) -> str:
    """Significant figures, no trailing zeros: 0.09375 -> "0.0938", 0.5 -> "0.5", 11.4 -> "11.4"."""
    if value == 0:
        return "0"
    d = Decimal(repr(value))
    places = digits - d.adjusted() - 1
    return f"{_round(value, places).normalize():,f}"


def distance(d: float | str) -> str:
    return "0 (the reference)" if d == "reference" else d if isinstance(d, str) else significant(d)


def ratio(r: float) -> str:
    """How many times: "1.84×" below ten, whole numbers from ten ("11×")."""
    return f"{_round(r, 2 if r < 10 else 0)}×"


def change(r: float) -> str:
    """A ratio as a signed change in percent, one decimal: 1.024 -> "+2.4%", 0.721 -> "−27.9%"."""
    pct = _round((r - 1) * 100, 1)
    return f"+{pct}%" if pct >= 0 else f"{MINUS}{-pct}%"


def against(row: Row, results: Results) -> str:
    """The table's "against" cell, naming the other row as shown: "0.59× transformers, compiled" or
    "+2.4% from vLLM"."""
    a = row.against
    if a is None:
        return ""
    found = results.find(a.row)
    assert found is not None  # validated results name rows that are there
    other = found.name
    return f"{change(a.ratio)} from {other}" if a.export else f"{ratio(a.ratio)} {other}"


def parameters(n: int) -> str:
    """Parameter counts as model cards give them: "4B", "494M", "134.5M" (one decimal, .0 dropped)."""
    for scale, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= scale:
            return f"{_round(n / scale, 1).normalize():f}{suffix}"
    return str(n)


def tick(value: float) -> str:
    """Axis ticks: plain, no separators, no trailing zeros ("7500", "2.5")."""
    return f"{_round(value, 6).normalize():f}"


def count(n: int, noun: str) -> str:
    """"1 run", "44 runs"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def when(timestamp: str) -> str:
    """When a run was measured, to the minute, as its heading shows it: "2026-12-03 15:25"."""
    return timestamp[:16].replace("T", " ")


def protocol(p: Protocol) -> str:
    """A protocol in one line: what one request and, where there is one, the serving load were."""
    line = (f"{p.prompt_tokens} prompt tokens, {p.new_tokens} new · batch {p.batch} · "
            f"median of {p.runs} runs after {p.warmups} warm-ups")
    s = p.serving
    if s is None:
        return line
    return (f"{line} · serving {s.requests} requests of {s.prompt_tokens_min}-{s.prompt_tokens_max} prompt tokens "
            f"and {s.new_tokens} new, at most {s.max_in_flight} in flight")
