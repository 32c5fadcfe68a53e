"""Side-by-side tables match a row across runs by its id, so a renamed row stays one line."""
from __future__ import annotations

import dataclasses

from linnet import registry
from linnet.results import load_results
from linnet.site import compare


def test_a_renamed_row_is_one_line_under_its_first_name():
    before = load_results(registry.RESULTS_DIR / "qwen2.5-0.5b-instruct.h100-2026-09-28.json")
    after = dataclasses.replace(before, rows=[
        dataclasses.replace(r, name="Linnet, CUDA graphs, renamed") if r.id == "torch:cudagraphs" else r
        for r in before.rows])
    tables = {t.metric: t for t in compare.tables([before, after])}
    decode = tables["decode_tok_s"]
    names = [line.name for line in decode.lines]
    assert names.count("Linnet, CUDA graphs") == 1 and "Linnet, CUDA graphs, renamed" not in names
    line = decode.lines[names.index("Linnet, CUDA graphs")]
    assert [c.text for c in line.cells] == ["908 tok/s", "908 tok/s"] and line.cells[1].change == "+0.0%"
    # vLLM shows in two groups, as two rows with two ids: one line in each.
    assert [line.group for line in tables["load_s"].lines if line.name == "vLLM"] == [
        "LLM engines", "Serving many requests"]
