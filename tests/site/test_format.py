"""Number formatting as on the seed pages."""
from __future__ import annotations

import pytest

from linnet import registry
from linnet.results import load_results
from linnet.site import format as fmt


@pytest.mark.parametrize("value, text", [
    (20.7, "20.7"), (50, "50.0"), (7.64, "7.64"), (0.42, "0.42"), (1.9, "1.90"), (123, "123"),
    (8196, "8,196"), (34643, "34,643"), (1666, "1,666"),
    (9.997, "10.0"), (99.96, "100"), (0.005, "0.01"),  # rounding up into the next magnitude
    (0.125, "0.13"),  # half-up on the decimal digits, not half-even on the binary float
])
def test_figure(value: float, text: str):
    assert fmt.figure(value) == text


def test_metric_units():
    assert [fmt.metric(v, k) for v, k in [(8196, "serve_tok_s"), (659, "load_s"), (44.8, "peak_mem_gib")]] == [
        "8,196 tok/s", "659 s", "44.8 GiB"]


@pytest.mark.parametrize("value, text", [
    ("reference", "0 (the reference)"), ("not compared", "not compared"),
    (0.09375, "0.0938"), (0.3125, "0.313"), (0.1875, "0.188"), (0.5, "0.5"), (0.25, "0.25"),
    (11.4, "11.4"), (5.98, "5.98"), (1234.5, "1,230"),
])
def test_distance(value, text: str):
    assert fmt.distance(value) == text


def test_ratio_and_change():
    assert [fmt.ratio(r) for r in (0.59, 1.36, 2.0, 4.81, 11, 11.22)] == [
        "0.59×", "1.36×", "2.00×", "4.81×", "11×", "11×"]
    assert [fmt.change(r) for r in (1.024, 0.721, 1.394, 1.014, 1.0)] == [
        "+2.4%", "\u221227.9%", "+39.4%", "+1.4%", "+0.0%"]


def test_against_cell_names_the_other_row_as_shown():
    results = load_results(registry.RESULTS_DIR / "qwen2.5-0.5b-instruct.h100-2026-09-28.json")
    assert fmt.against(results.find("torch:inductor"), results) == "1.71× transformers, compiled"
    assert fmt.against(results.find("vllm:linnet-export"), results) == "\u221227.9% from vLLM"
    assert fmt.against(results.find("transformers"), results) == ""


def test_parameters_and_ticks():
    assert [fmt.parameters(n) for n in (4_022_468_096, 494_032_768, 134_515_008, 7_000)] == [
        "4B", "494M", "134.5M", "7K"]
    assert [fmt.tick(t) for t in (0.0, 2500.0, 30000.0, 2.5, 0.1 + 0.2)] == ["0", "2500", "30000", "2.5", "0.3"]


def test_a_protocol_in_one_line():
    from linnet.registry.schema import Protocol, Serving

    one = Protocol(prompt_tokens=128, new_tokens=32, batch=1, runs=3, warmups=1)
    assert fmt.protocol(one) == "128 prompt tokens, 32 new · batch 1 · median of 3 runs after 1 warm-ups"
    serving = Protocol(512, 64, 16, 2, 1, Serving(64, 128, 512, 64, 16))
    assert fmt.protocol(serving).endswith(
        "· serving 64 requests of 128-512 prompt tokens and 64 new, at most 16 in flight")
    assert (fmt.count(1, "run"), fmt.count(44, "run")) == ("1 run", "44 runs")
