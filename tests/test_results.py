"""The results format: the bundled files validate, round-trip, and broken files name file and field."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from linnet import registry
from linnet.errors import ResultsError
from linnet.results import GROUPS, Against, Metric, Row, from_data, load_results, save_results, to_data

BUNDLED = sorted(registry.RESULTS_DIR.glob("*.json"))
QWEN25 = registry.RESULTS_DIR / "qwen2.5-0.5b-instruct.h100-2026-09-28.json"


def test_bundled_results_validate():
    assert len(BUNDLED) == 2
    known = {e.id for e in registry.entries()}
    for path in BUNDLED:
        results = load_results(path)
        assert results.model in known and path.name.startswith(results.model + ".")
        assert results.machine.accelerator == "NVIDIA H100 80GB HBM3"
        assert [g for g in GROUPS if any(r.group == g for r in results.rows)] == list(GROUPS)
        assert len(results.rows) == 26
        # Published medians only: no samples are claimed.
        assert all(m.samples is None for r in results.rows for m in r.metrics.values())


def test_save_then_load_is_the_same(tmp_path: Path):
    results = load_results(QWEN25)
    results.rows[0].metrics["ttft_ms"] = Metric(12.4, samples=[12.1, 12.4, 12.9])
    save_results(results, tmp_path / "r.json")
    assert load_results(tmp_path / "r.json") == results
    assert json.loads((tmp_path / "r.json").read_text())["rows"][0]["metrics"]["ttft_ms"]["samples"] == [
        12.1, 12.4, 12.9]


def test_save_refuses_an_invalid_run(tmp_path: Path):
    results = load_results(QWEN25)
    results.rows.append(Row(id="x", group="Elsewhere", name="x"))
    with pytest.raises(ResultsError, match=r"rows\[26\] \(x\)\.group"):
        save_results(results, tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()


def _row(data: dict, row_id: str) -> dict:
    return next(r for r in data["rows"] if r["id"] == row_id)


def _set(path: str, value):
    def change(data):
        *parents, last = path.split(".")
        for key in parents:
            data = data[key]
        if value is KeyError:
            del data[last]
        else:
            data[last] = value
    return change


def _on_row(row_id: str, change):
    return lambda data: change(_row(data, row_id))


BROKEN = [
    # (how to break the file, the field path the message must name, what it must say)
    (_set("schema_version", 1), "schema_version", "reads version 2, not 1"),
    (_set("model", KeyError), "model", "missing"),
    (_set("timestamp", "2026-09-28T17:31:05"), "timestamp", "no UTC offset"),
    (_set("timestamp", "yesterday"), "timestamp", "not an ISO 8601"),
    (_set("protocol.runs", 0), "protocol.runs", "must be positive"),
    (_set("machine.threads", "two"), "machine.threads", "expected an integer"),
    (_on_row("transformers", _set("group", "Torch")), "rows[0] (transformers).group", "not one of"),
    (_on_row("transformers", _set("metrics.tok_s", {"value": 1})), "rows[0] (transformers).metrics.tok_s",
     "unknown metric"),
    (_on_row("transformers", _set("metrics.ttft_ms.value", -1)), "rows[0] (transformers).metrics.ttft_ms",
     "positive"),
    (_on_row("transformers", _set("metrics.ttft_ms.samples", [])), "rows[0] (transformers).metrics.ttft_ms.samples",
     "empty"),
    (_on_row("transformers", _set("metrics.ttft_ms.value", "fast")), "rows[0].metrics.ttft_ms.value",
     "expected a number"),
    (_on_row("transformers", _set("distance", "far")), "rows[0].distance", "'reference', 'not compared'"),
    (_on_row("transformers", _set("not_run", "no GPU")), "rows[0] (transformers).not_run", "no metrics"),
    (_on_row("torch:inductor", _set("against.row", "transformers, compiled")), "rows[3] (torch:inductor).against.row",
     "no row with id 'transformers, compiled'"),  # a row's shown name is not its id
    (_on_row("torch:inductor", _set("against.ratio", 3.0)), "rows[3] (torch:inductor).against.ratio",
     "disagrees with the values"),
    (_on_row("torch:inductor", _set("against.metric", "serve_tok_s")), "rows[3] (torch:inductor).against.metric",
     "missing"),
    # Every row has an id, unique in its file: rows are found by id, never by the name shown.
    (_on_row("torch:inductor", _set("id", KeyError)), "rows[3].id", "missing"),
    (_on_row("torch:inductor", _set("id", " ")), "rows[3] (Linnet, inductor).id", "empty"),
    (_on_row("torch:inductor", _set("id", "torch:eager")), "rows[3] (torch:eager).id", "rows[2] has this id already"),
    (lambda d: d["rows"].append(copy.deepcopy(d["rows"][0])), "rows[26] (transformers).id",
     "rows[0] has this id already"),
    (_on_row("torch:inductor", _set("name", "Linnet, generated PyTorch")), "rows[3] (torch:inductor).name",
     "a second row named 'Linnet, generated PyTorch' in PyTorch"),
]


@pytest.mark.parametrize("breaks, field, says", BROKEN, ids=[b[1] for b in BROKEN])
def test_broken_results_name_file_and_field(tmp_path: Path, breaks, field: str, says: str):
    data = json.loads(QWEN25.read_text())
    breaks(data)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ResultsError) as e:
        load_results(path)
    assert str(e.value).startswith(f"{path}: {field}"), str(e.value)
    assert says in str(e.value)


def test_not_json(tmp_path: Path):
    (tmp_path / "r.json").write_text("{")
    with pytest.raises(ResultsError, match="r.json: not valid JSON"):
        load_results(tmp_path / "r.json")


def test_a_row_not_run_and_an_export_comparison():
    data = to_data(load_results(QWEN25))
    data["rows"].append({"id": "sglang", "group": "LLM engines", "name": "SGLang", "not_run": "needs CUDA 13"})
    results = from_data(data)
    sglang = results.find("sglang")
    assert sglang.not_run == "needs CUDA 13" and sglang.distance == "not compared" and not sglang.linnet
    export = results.find("vllm:linnet-export")
    assert export.name == "vLLM on Linnet's export" and not export.linnet
    assert export.against == Against(row="vllm", metric="decode_tok_s", ratio=0.721, export=True)


def test_bundled_rows_have_stable_ids():
    """Linnet's PyTorch rows are the torch backends' registry ids; peers and serving rows name their engine."""
    for path in BUNDLED:
        rows = load_results(path).rows
        assert [r.id for r in rows if r.group == "PyTorch"] == [
            "transformers", "transformers:compiled", "torch:eager", "torch:inductor", "torch:cudagraphs"]
        assert {r.id for r in rows if r.linnet and r.group == "Serving many requests"} == {
            "serve:torch:cudagraphs", "serve:jax", "serve:onnx", "triton:linnet"}
        assert not any(r.linnet for r in rows if r.group == "LLM engines")
