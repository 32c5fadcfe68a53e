"""The history's tables: runs of one model, one machine kind and one protocol, side by side, per metric.

Only runs of one kind and protocol are passed in, so a change is never computed across machines or protocols.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from linnet.results import GROUPS, METRICS, Row
from linnet.site import format as fmt
from linnet.site.runs import Run


@dataclass(frozen=True)
class Cell:
    text: str  # the value, or a dash
    change: str = ""  # against the latest earlier run with a value: "+12.3%"
    better: bool | None = None  # whether that change is for the better; None when there is none
    since: int | None = None  # the index of that earlier run, where there is a change


@dataclass(frozen=True)
class Line:
    group: str
    name: str
    cells: list[Cell]


@dataclass(frozen=True)
class Table:
    metric: str
    lines: list[Line]


def tables(runs: Sequence[Run]) -> list[Table]:
    """One table per metric that any run has, the runs oldest first; a value also shows its change from the
    latest earlier run that has one. The runs must share one machine kind and one protocol.

    Rows are matched across runs by id, so a row renamed between runs stays one line, shown as first named.
    """
    if len({(r.kind, r.protocol) for r in runs}) > 1:
        raise ValueError("a change is only computed between runs of one machine kind and one protocol")
    first: dict[str, Row] = {}  # each id's first row, in page order
    for group in GROUPS:
        for run in runs:
            for row in run.results.rows:
                if row.group == group:
                    first.setdefault(row.id, row)
    found = []
    for metric in METRICS:
        lines = []
        for row_id, row in first.items():
            values = [_value(run.results.find(row_id), metric) for run in runs]
            if any(v is not None for v in values):
                lines.append(Line(row.group, row.name, _cells(values, metric)))
        if lines:
            found.append(Table(metric, lines))
    return found


def _value(row: Row | None, metric: str) -> float | None:
    return None if row is None else row.value(metric)


def _cells(values: list[float | None], metric: str) -> list[Cell]:
    cells: list[Cell] = []
    since: int | None = None  # the latest run so far with a value
    for i, value in enumerate(values):
        if value is None:
            cells.append(Cell(fmt.DASH))
            continue
        text = fmt.metric(value, metric)
        before = None if since is None else values[since]
        if before is None:
            cells.append(Cell(text))
        else:
            better = None if value == before else (value < before) == METRICS[metric]
            cells.append(Cell(text, fmt.change(value / before), better, since))
        since = i
    return cells
