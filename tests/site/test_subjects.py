"""One id and one name per subject, whatever a results file called it."""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

import pytest

from linnet import registry
from linnet.errors import ResultsError
from linnet.results import Against, Metric, Results, Row, load_results
from linnet.site.subjects import canonical, identify, weight_form

DOCS_RESULTS = Path(__file__).parents[2] / "docs" / "results"
QWEN25 = registry.RESULTS_DIR / "qwen2.5-0.5b-instruct.h100-2026-09-28.json"
READS = "reads 1990.29 MB per token (weights 1976.13 MB in {form}, KV cache 14.16 MB in f32 at 576 positions)"


@pytest.mark.parametrize("row, expected", [
    # Earlier files: no form in the id, the form in a note; later ones: the form in the id.
    (Row("torch:inductor", "PyTorch", "Linnet, inductor", True, notes=[READS.format(form="f32")]),
     ("torch:inductor@f32", "Linnet, inductor f32")),
    (Row("torch:inductor@f32", "PyTorch", "Linnet, inductor f32", True),
     ("torch:inductor@f32", "Linnet, inductor f32")),
    (Row("onnx:cpu", "ONNX Runtime and TensorRT", "Linnet, ONNX Runtime CPU", True,
         notes=["weights 525.12 MB in q8_0, f32"]), ("onnx:cpu@q8_0", "Linnet, ONNX Runtime CPU q8_0")),
    (Row("llama.cpp", "LLM engines", "llama.cpp", notes=["weights bf16, f32 (exported from the HF directory)"]),
     ("llama.cpp@bf16", "llama.cpp bf16")),
    (Row("transformers", "PyTorch", "transformers", notes=["f32"]), ("transformers@f32", "transformers f32")),
    # linnet.serve on a backend, as bench-serve named it and as the seeds name it.
    (Row("serve:torch:inductor", "Serving many requests", "linnet.serve, Linnet, inductor", True),
     ("serve:torch:inductor", "linnet.serve, inductor")),
    (Row("serve:jax", "Serving many requests", "linnet.serve, XLA", True), ("serve:xla", "linnet.serve, XLA")),
    (Row("triton:linnet:onnx:cpu", "Serving many requests", "Triton hosting linnet.serve, Linnet, ONNX Runtime CPU",
         True), ("triton:linnet:onnx:cpu", "Triton, linnet.serve backend, ONNX Runtime CPU")),
    # The published rows keep the seed pages' names.
    (Row("jax:generated", "JAX", "Linnet, XLA (generated JAX)", True), ("xla:jax", "Linnet, XLA (generated JAX)")),
    (Row("onnx:cuda@f16", "ONNX Runtime and TensorRT", "Linnet, ONNX Runtime f16", True, notes=["f16"]),
     ("onnx:cuda@f16", "Linnet, ONNX Runtime f16")),
    (Row("onnx:tensorrt@bf16", "ONNX Runtime and TensorRT", "Linnet, ONNX Runtime TensorRT bf16", True),
     ("onnx:tensorrt@bf16", "Linnet, TensorRT bf16")),
    (Row("torch:inductor", "PyTorch", "Linnet, inductor", True, notes=["KV cache compiled for 768 positions"]),
     ("torch:inductor", "Linnet, inductor")),
])
def test_a_row_is_named_from_what_it_is(row: Row, expected: tuple[str, str]):
    assert identify(row) == expected


def test_a_note_without_the_weights_says_no_form():
    assert weight_form(Row("onnx:cpu", "ONNX Runtime and TensorRT", "x", True, notes=["2 intra-op threads"])) is None


def test_comparisons_follow_the_new_ids():
    published = canonical(load_results(QWEN25))
    rows = {r.id: r for r in published.rows}
    assert "jax:generated" not in rows and rows["xla:jax"].name == "Linnet, XLA (generated JAX)"
    assert rows["xla:jax"].against == Against("keras-hub", "decode_tok_s", 1.47)
    assert rows["triton:linnet"].against is not None and rows["triton:linnet"].against.row == "triton:vllm"


def test_two_rows_that_are_one_subject_are_refused():
    base = load_results(QWEN25)
    twice = [Row("onnx:cpu", "ONNX Runtime and TensorRT", "Linnet, ONNX Runtime CPU", True, {"ttft_ms": Metric(1.0)},
                 notes=["f32"]),
             Row("onnx:cpu@f32", "ONNX Runtime and TensorRT", "Linnet, ONNX Runtime CPU f32", True,
                 {"ttft_ms": Metric(1.0)})]
    with pytest.raises(ResultsError, match=r"r\.json: rows 'onnx:cpu' and 'onnx:cpu@f32' are one subject"):
        canonical(dataclasses.replace(base, rows=twice), "r.json")


def test_every_results_file_gives_each_subject_one_name():
    """Across Linnet's own runs (current and archived) and the published ones, an id has one name, and a
    Linnet row's name never depends on the file it came from."""
    names: dict[str, set[str]] = defaultdict(set)
    files = [*DOCS_RESULTS.glob("*.json"), *DOCS_RESULTS.glob("archive/*.json"), *registry.RESULTS_DIR.glob("*.json")]
    assert len(files) > 80
    for path in files:
        results: Results = canonical(load_results(path), str(path))
        for row in results.rows:
            names[row.id].add(row.name)
    assert {i: n for i, n in names.items() if len(n) > 1} == {}
    # The names the issue found split: each is now one subject.
    assert names["torch:inductor@f32"] == {"Linnet, inductor f32"}
    assert names["onnx:cpu@f32"] == {"Linnet, ONNX Runtime CPU f32"}
    assert "onnx:cpu" not in names and "jax:generated" not in names
