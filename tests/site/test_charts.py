"""Chart geometry: the seeds' axes, one red bar on the best row, memory that is a setting left out."""
from __future__ import annotations

import dataclasses

import pytest

from linnet import registry
from linnet.results import METRICS, Metric, Row, load_results
from linnet.site import charts

# The largest drawn value of each chart on the two seed pages, and the ticks they show.
SEED_AXES = [
    (38.6, "0 10 20 30 40"), (255, "0 100 200"), (8196, "0 2500 5000 7500"), (5981, "0 2000 4000 6000"),
    (659, "0 200 400 600"), (44.8, "0 20 40"), (12.4, "0 5 10"), (1055, "0 500 1000"),
    (34643, "0 10000 20000 30000"), (7317, "0 2000 4000 6000"), (621, "0 200 400 600"), (10.1, "0 5 10"),
]


@pytest.mark.parametrize("largest, ticks", SEED_AXES)
def test_axis_matches_the_seeds(largest: float, ticks: str):
    extent, values = charts.axis(largest)
    assert " ".join(f"{v:g}" for v in values) == ticks
    assert extent > largest and values[-1] <= extent


def test_axis_of_nothing():
    assert charts.axis(0) == (1.0, [0.0, 1.0])


@pytest.fixture(scope="module")
def qwen3():
    return load_results(registry.RESULTS_DIR / "qwen3-4b.h100-2026-09-28.json")


@pytest.mark.parametrize("metric", METRICS)
def test_the_best_bar_is_red(qwen3, metric: str):
    chart = charts.chart(qwen3, metric, "t")
    red = [b for b in chart.bars if b.fill == charts.RED]
    assert len(red) == 1 and red[0].best
    drawn = [r for r in qwen3.rows if r.value(metric) is not None
             and not (metric == "peak_mem_gib" and r.memory_is_setting)]
    best = (min if METRICS[metric] else max)(drawn, key=lambda r: r.value(metric))
    assert red[0].name == best.name
    assert all(b.fill == charts.GREY for b in chart.bars if b is not red[0])
    assert [b.name for b in chart.bars] == [r.name for r in drawn]  # table order, groups as on the seed
    assert chart.ticks[-1].text.endswith(" " + {"ttft_ms": "ms", "serve_ttft_ms": "ms", "load_s": "s",
                                                "peak_mem_gib": "GiB"}.get(metric, "tok/s"))


def test_memory_that_is_a_setting_is_not_drawn(qwen3):
    names = {b.name for b in charts.chart(qwen3, "peak_mem_gib", "t").bars}
    assert "vLLM" not in names and "transformers, batched" not in names
    assert "linnet.serve, CUDA graphs" in names


def test_bars_are_proportional_and_visible(qwen3):
    chart = charts.chart(qwen3, "load_s", "t")
    widths = {b.name: b.width for b in chart.bars}
    assert widths["Triton, linnet.serve backend"] == pytest.approx(100 / charts.HEADROOM)
    assert widths["llama.cpp on Linnet's GGUF"] / widths["KerasHub"] == pytest.approx(29.8 / 17.0)
    assert widths["Linnet, CUDA graphs"] == charts.MIN_WIDTH  # 1.83 s of 659 s would not show
    assert min(widths.values()) >= charts.MIN_WIDTH


def test_groups_and_rows_without_the_metric(qwen3):
    chart = charts.chart(qwen3, "serve_ttft_ms", "t")
    assert [g.text for g in chart.groups] == ["Serving many requests"]
    assert len(chart.bars) == 5
    only_load = dataclasses.replace(qwen3, rows=[Row("x", "PyTorch", "x", {"load_s": Metric(1.0)})])
    assert charts.chart(only_load, "ttft_ms", "t") is None
