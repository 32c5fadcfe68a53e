"""The results format: one benchmark run of one registry model on one machine, as versioned JSON.

Bench code builds a ``Results`` and calls ``save_results``; pages call ``load_results``. Both check the
whole file with ``validate``, so a page is never drawn from a file that breaks the format. A metric's
``value`` is the figure shown (the median, for timings); ``samples`` are the raw measurements, or None
where they were not kept (published results record only the medians).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, NoReturn

from linnet.errors import ResultsError
from linnet.files import atomic_write, read_json
from linnet.registry.schema import Protocol, Serving, check_protocol, parse

SCHEMA_VERSION = 2  # 2: rows carry a stable id and whether they are Linnet's; comparisons name ids

# Row groups, in page order.
GROUPS = ("PyTorch", "JAX", "ONNX Runtime and TensorRT", "LLM engines", "Serving many requests")
# metric -> True where lower is better.
METRICS = {
    "ttft_ms": True,
    "decode_tok_s": False,
    "serve_tok_s": False,
    "serve_ttft_ms": True,
    "load_s": True,
    "peak_mem_gib": True,
}
# A comparison's ratio must agree with its two values. Published pages round values to three figures
# and ratios to two ("11x"), so this catches a comparison with the wrong row or metric, not rounding.
RATIO_TOLERANCE = 0.05

__all__ = [
    "Against", "GROUPS", "METRICS", "Machine", "Metric", "Protocol", "Results", "Row",
    "SCHEMA_VERSION", "Serving", "load_results", "save_results", "validate",
]


@dataclass
class Metric:
    value: float
    samples: list[float] | None = None


@dataclass
class Against:
    """The row this one is compared with, on one metric.

    ``ratio`` is how many times better this row is (>1: faster), computed from the unrounded values.
    ``export`` marks an exported checkpoint measured against the original in the same engine; pages
    show it as a change in percent rather than a speed-up.
    """

    row: str  # the other row's id
    metric: str
    ratio: float
    export: bool = False


@dataclass
class Row:
    """One subject's numbers. Code finds rows by ``id``; ``name`` is only shown.

    Ids are stable across runs and renames: a Linnet backend's is its registry id (``torch:inductor``),
    a peer's names its engine and variant (``transformers:compiled``, ``vllm``), and a serving row's names
    what serves (``serve:torch:cudagraphs`` for linnet.serve, ``triton:vllm``).
    """

    id: str
    group: str
    name: str
    linnet: bool = False  # runs Linnet's own code (a backend, linnet.serve), not another engine's
    metrics: dict[str, Metric] = field(default_factory=dict)
    # The largest absolute difference of its logits from the reference's, or why there is none.
    distance: float | Literal["reference", "not compared"] = "not compared"
    against: Against | None = None
    memory_is_setting: bool = False  # e.g. a KV-cache pool reserved up front: not drawn in the chart
    notes: list[str] = field(default_factory=list)
    not_run: str | None = None  # the reason, for a peer that could not run here

    def value(self, metric: str) -> float | None:
        m = self.metrics.get(metric)
        return None if m is None else m.value

    def measured(self, metric: str) -> float:
        """``value(metric)`` of a row known to hold it."""
        v = self.value(metric)
        assert v is not None, f"row {self.id} has no {metric}"
        return v


SERVING_GROUP = "Serving many requests"  # the group of every serving row (linnet.bench.serving)


@dataclass
class Machine:
    """What it ran on; None where it was not recorded."""

    accelerator: str | None  # e.g. "NVIDIA H100 80GB HBM3"; None for CPU only
    cpu: str | None = None
    memory_gib: float | None = None
    threads: int | None = None
    load_average: list[float] | None = None  # 1, 5 and 15 minutes, when the run started
    read_gb_s: Metric | None = None  # read bandwidth measured in the run (linnet.bench.bandwidth), GB/s
    matmul_gflop_s: Metric | None = None  # matrix-product rate measured in the run (linnet.bench.arithmetic)


@dataclass
class Results:
    model: str  # registry id
    timestamp: str  # ISO 8601 with a UTC offset
    machine: Machine
    versions: dict[str, str]  # in the order the page lists them: {"Linnet": "0.1.0", ...}
    protocol: Protocol
    rows: list[Row]
    provenance: str | None = None  # where the numbers come from, if not measured by this harness
    profile: str | None = None  # the named protocol it ran under (linnet.bench.all.PROFILES), if any
    schema_version: int = SCHEMA_VERSION

    def find(self, row_id: str) -> Row | None:
        return next((r for r in self.rows if r.id == row_id), None)


def validate(results: Results, where: str = "results") -> None:
    """What types alone cannot say; raises ResultsError naming ``where`` and the field."""
    def fail(path: str, message: str) -> NoReturn:
        raise ResultsError(f"{where}: {path}: {message}")

    if results.schema_version != SCHEMA_VERSION:
        fail("schema_version", f"this Linnet reads version {SCHEMA_VERSION}, not {results.schema_version}")
    try:
        if datetime.fromisoformat(results.timestamp).utcoffset() is None:
            fail("timestamp", f"{results.timestamp!r} has no UTC offset")
    except ValueError:
        fail("timestamp", f"{results.timestamp!r} is not an ISO 8601 date and time")
    check_protocol(results.protocol, where, "protocol", ResultsError)
    for name in ("read_gb_s", "matmul_gflop_s"):
        rate = getattr(results.machine, name)
        for v in [] if rate is None else [rate.value, *(rate.samples or [])]:
            if not math.isfinite(v) or v <= 0:
                fail(f"machine.{name}", f"{v!r} is not a finite, positive number")
    ids: dict[str, int] = {}
    names = set()
    for i, row in enumerate(results.rows):
        path = f"rows[{i}] ({row.id})"
        if not row.id.strip():
            fail(f"rows[{i}] ({row.name}).id", "empty: every row needs a stable id")
        if row.id in ids:
            fail(f"{path}.id", f"rows[{ids[row.id]}] has this id already")
        ids[row.id] = i
        if row.group not in GROUPS:
            fail(f"{path}.group", f"{row.group!r} is not one of {', '.join(GROUPS)}")
        if (row.group, row.name) in names:  # two rows a page could not tell apart
            fail(f"{path}.name", f"a second row named {row.name!r} in {row.group}")
        names.add((row.group, row.name))
        for key, metric in row.metrics.items():
            if key not in METRICS:
                fail(f"{path}.metrics.{key}", f"unknown metric (known: {', '.join(METRICS)})")
            for v in [metric.value, *(metric.samples or [])]:
                if not math.isfinite(v) or v <= 0:  # nothing measured is a row "not run", not a zero
                    fail(f"{path}.metrics.{key}", f"{v!r} is not a finite, positive number")
            if metric.samples == []:
                fail(f"{path}.metrics.{key}.samples", "empty: give the samples, or null if unknown")
        if row.not_run is not None and (row.metrics or row.against):
            fail(f"{path}.not_run", "a row that did not run has no metrics and no comparison")
    for i, row in enumerate(results.rows):  # once every row's values are known to be positive
        if row.against is not None:
            _check_against(results, row, f"rows[{i}] ({row.id}).against", fail)


def _check_against(results: Results, row: Row, path: str, fail: Callable[[str, str], NoReturn]) -> None:
    a = row.against
    assert a is not None  # the caller's check
    other = results.find(a.row)
    if other is None:
        fail(f"{path}.row", f"no row with id {a.row!r}")
    if a.metric not in METRICS:
        fail(f"{path}.metric", f"unknown metric {a.metric!r}")
    mine, theirs = row.value(a.metric), other.value(a.metric)
    if mine is None or theirs is None:
        fail(f"{path}.metric", f"{a.metric} is missing from {row.id if mine is None else a.row}")
    better = theirs / mine if METRICS[a.metric] else mine / theirs
    if not math.isclose(a.ratio, better, rel_tol=RATIO_TOLERANCE):
        fail(f"{path}.ratio", f"{a.ratio} disagrees with the values ({better:.3f})")


def from_data(data: Any, where: str = "results") -> Results:
    """Check plain JSON data and build Results from it."""
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != SCHEMA_VERSION:  # say so first: an older file's other fields may differ too
        raise ResultsError(f"{where}: schema_version: this Linnet reads version {SCHEMA_VERSION}, "
                           f"not {version!r}")
    results = parse(Results, data, where, ResultsError)
    validate(results, where)
    return results


def to_data(results: Results) -> dict[str, Any]:
    data = dataclasses.asdict(results)
    return {"schema_version": data.pop("schema_version"), **data}  # the version first, for readers


def load_results(path: Path | str) -> Results:
    path = Path(path)
    return from_data(read_json(path, ResultsError), str(path))


def save_results(results: Results, path: Path | str) -> None:
    """Validate, then write (indented, so results diff well in git), whole or not at all."""
    validate(results, str(path))
    text = json.dumps(to_data(results), indent=1, ensure_ascii=False)
    atomic_write(path, lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"))
