"""Bar charts as plain geometry; ``templates/chart.svg.jinja`` draws them as inline SVG.

Horizontal positions are percentages of the chart's width and vertical ones are pixels, so a chart
fills any column from a phone to a laptop without scaling its text.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from linnet.results import GROUPS, METRICS, Results
from linnet.site import format as fmt

RED = "#d7263d"  # the best bar
GREY = "#8a94a6"

GROUP_HEIGHT = 30  # a group's label row
BAR_HEIGHT = 36  # a bar's row: its name and value on one line, the bar under them
AXIS_HEIGHT = 24  # tick labels above the first group
HEADROOM = 1.05  # the axis runs 5% past the longest bar
MIN_WIDTH = 0.5  # percent: a bar too short to see would hide which one is red


@dataclass(frozen=True)
class Bar:
    name: str
    value: str  # formatted, with its unit
    y: int
    width: float  # percent of the chart's width
    best: bool

    @property
    def fill(self) -> str:
        return RED if self.best else GREY


@dataclass(frozen=True)
class Label:
    text: str
    y: int


@dataclass(frozen=True)
class Tick:
    text: str
    x: float  # percent
    anchor: str  # SVG text-anchor: the end ticks keep their labels inside the chart


@dataclass(frozen=True)
class Chart:
    metric: str
    title: str
    bars: list[Bar]
    groups: list[Label]
    ticks: list[Tick]
    height: int


def axis(largest: float) -> tuple[float, list[float]]:
    """The axis' extent and its ticks.

    The step is the smallest of 1, 2, 2.5 and 5 times a power of ten that takes fewer than four steps
    to the largest value, so an axis carries three to five ticks ("0 10 20 30 40", "0 2500 5000 7500").
    """
    if largest <= 0:
        return 1.0, [0.0, 1.0]
    extent = largest * HEADROOM
    power = 10.0 ** (math.floor(math.log10(largest)) - 1)
    steps = (m * power * 10**k for k in range(3) for m in (1, 2, 2.5, 5))
    step = next(s for s in steps if largest / s < 4)
    count = math.floor(extent / step + 1e-9)
    return extent, [i * step for i in range(count + 1)]


def chart(results: Results, metric: str, title: str) -> Chart | None:
    """One metric's bars, grouped as in the table; rows whose memory is a setting are left out."""
    rows = [r for r in results.rows if r.value(metric) is not None
            and not (metric == "peak_mem_gib" and r.memory_is_setting)]
    if not rows:
        return None
    pick = min if METRICS[metric] else max
    best = pick(rows, key=lambda r: r.measured(metric))  # the first of equals: one red bar per chart
    extent, tick_values = axis(max(r.measured(metric) for r in rows))
    ticks = [Tick(fmt.tick(t), 100 * t / extent, "middle") for t in tick_values]
    ticks[0] = Tick(ticks[0].text, 0, "start")
    last = ticks[-1]
    ticks[-1] = Tick(f"{last.text} {fmt.UNITS[metric]}", last.x, "end" if last.x > 90 else "middle")

    bars: list[Bar] = []
    groups: list[Label] = []
    y = AXIS_HEIGHT
    for group in GROUPS:
        members = [r for r in rows if r.group == group]
        if not members:
            continue
        groups.append(Label(group, y))
        y += GROUP_HEIGHT
        for row in members:
            v = row.measured(metric)
            width = max(100 * v / extent, MIN_WIDTH)
            bars.append(Bar(row.name, fmt.metric(v, metric), y, width, row is best))
            y += BAR_HEIGHT
    return Chart(metric, title, bars, groups, ticks, y)
