"""History tables: a row is one line across runs, and a change is only ever from the run before, of one kind
and protocol."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from linnet import registry
from linnet.results import Machine, load_results
from linnet.site import compare, runs

QWEN25 = registry.RESULTS_DIR / "qwen2.5-0.5b-instruct.h100-2026-09-28.json"


def _run(name: str, **changes) -> runs.Run:
    return runs.run(Path(name), dataclasses.replace(load_results(QWEN25), **changes))


def test_a_renamed_row_is_one_line_under_its_first_name():
    before = load_results(QWEN25)
    renamed = [dataclasses.replace(r, name="Linnet, CUDA graphs, renamed") if r.id == "torch:cudagraphs" else r
               for r in before.rows]
    tables = {t.metric: t for t in compare.tables([_run("a.json"), _run("b.json", rows=renamed)])}
    decode = tables["decode_tok_s"]
    names = [line.name for line in decode.lines]
    assert names.count("Linnet, CUDA graphs") == 1 and "Linnet, CUDA graphs, renamed" not in names
    line = decode.lines[names.index("Linnet, CUDA graphs")]
    assert [c.text for c in line.cells] == ["908 tok/s", "908 tok/s"] and line.cells[1].change == "+0.0%"
    # vLLM shows in two groups, as two rows with two ids: one line in each.
    assert [line.group for line in tables["load_s"].lines if line.name == "vLLM"] == [
        "LLM engines", "Serving many requests"]


def test_each_change_is_from_the_latest_earlier_run_with_a_value():
    base = load_results(QWEN25)

    def scaled(k: float) -> list:
        return [dataclasses.replace(r, metrics={m: dataclasses.replace(v, value=v.value * k)
                                                for m, v in r.metrics.items()}) for r in base.rows]

    without = [r for r in base.rows if r.id not in ("torch:cudagraphs", "serve:torch:cudagraphs")]
    four = [_run(f"{i}.json", rows=rows, timestamp=f"2026-10-0{i + 1}T00:00:00+00:00")
            for i, rows in enumerate((scaled(1), scaled(2), without, scaled(3)))]
    decode = next(t for t in compare.tables(four) if t.metric == "decode_tok_s")
    cells = next(line.cells for line in decode.lines if line.name == "Linnet, CUDA graphs")
    # The third run lacks the row: the fourth's change is from the second.
    assert [(c.text, c.change, c.better, c.since) for c in cells] == [
        ("908 tok/s", "", None, None), ("1,816 tok/s", "+100.0%", True, 0), ("–", "", None, None),
        ("2,724 tok/s", "+50.0%", True, 1)]


@pytest.mark.parametrize("other", [
    {"machine": Machine(accelerator="NVIDIA H200")},
    {"protocol": dataclasses.replace(load_results(QWEN25).protocol, runs=3)},
])
def test_no_change_across_machine_kinds_or_protocols(other):
    with pytest.raises(ValueError, match="one machine kind and one protocol"):
        compare.tables([_run("a.json"), _run("b.json", **other)])
