"""Several results files for one model (two machines, before and after), side by side, per metric."""
from __future__ import annotations

from dataclasses import dataclass

from linnet.results import GROUPS, METRICS, Results, Row
from linnet.site import format as fmt


@dataclass(frozen=True)
class Cell:
    text: str  # the value, or a dash
    change: str = ""  # against the first run: "+12.3%"
    better: bool | None = None  # whether that change is for the better; None when there is none


@dataclass(frozen=True)
class Line:
    group: str
    name: str
    cells: list[Cell]


@dataclass(frozen=True)
class Table:
    metric: str
    lines: list[Line]


def label(results: Results) -> str:
    """A run's column heading: its machine and when it ran."""
    machine = results.machine.accelerator or results.machine.cpu or "CPU"
    return f"{machine} · {results.timestamp[:16].replace('T', ' ')}"


def tables(runs: list[Results]) -> list[Table]:
    """One table per metric that any run has; each later run's value also shows its change from the first.

    Rows are matched across runs by id, so a row renamed between runs stays one line, shown as first named.
    """
    first: dict[str, Row] = {}  # each id's first row, in page order
    for group in GROUPS:
        for run in runs:
            for row in run.rows:
                if row.group == group:
                    first.setdefault(row.id, row)
    found = []
    for metric in METRICS:
        lines = []
        for row_id, row in first.items():
            values = [_value(run.find(row_id), metric) for run in runs]
            if any(v is not None for v in values):
                cells = [_cell(v, values[0] if i else None, metric) for i, v in enumerate(values)]
                lines.append(Line(row.group, row.name, cells))
        if lines:
            found.append(Table(metric, lines))
    return found


def _value(row: Row | None, metric: str) -> float | None:
    return None if row is None else row.value(metric)


def _cell(value: float | None, first: float | None, metric: str) -> Cell:
    """``first`` is None for the first run's own column, or where the first run lacks the value."""
    if value is None:
        return Cell(fmt.DASH)
    text = fmt.metric(value, metric)
    if first is None:
        return Cell(text)
    better = None if value == first else (value < first) == METRICS[metric]
    return Cell(text, fmt.change(value / first), better)
