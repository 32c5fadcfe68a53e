"""The cards find their rows by id and by whether a row is Linnet's, never by the name a page shows."""
from __future__ import annotations

import dataclasses

from linnet import registry
from linnet.results import Metric, Row, load_results
from linnet.site.cards import cards

QWEN25 = registry.RESULTS_DIR / "qwen2.5-0.5b-instruct.h100-2026-09-28.json"


def _sides(results) -> list[tuple[str, str, str, float]]:
    return [(c.spec.title, c.ours.id, c.theirs.id, c.ratio) for c in cards(results)]


def test_the_published_cards():
    assert [(title, ours, theirs) for title, ours, theirs, _ in _sides(load_results(QWEN25))] == [
        ("vs vLLM, one request", "jax:generated", "vllm"),
        ("vs the reference, in PyTorch", "torch:cudagraphs", "transformers:compiled"),
        ("vs KerasHub, in JAX", "jax:generated", "keras-hub"),
        ("exported to vLLM, SGLang, TGI", "vllm:linnet-export", "vllm"),
        ("vs vLLM, serving", "serve:torch:cudagraphs", "vllm:batched"),
        ("exported, serving", "vllm:batched:linnet-export", "vllm:batched"),
        ("vs vLLM, behind Triton", "triton:linnet", "triton:vllm"),
    ]


def test_renamed_rows_keep_their_cards():
    results = load_results(QWEN25)
    renamed = dataclasses.replace(results, rows=[dataclasses.replace(r, name=f"row {i}")
                                                 for i, r in enumerate(results.rows)])
    assert _sides(renamed) == _sides(results)


def test_a_new_linnet_backend_joins_the_cards_by_itself():
    results = load_results(QWEN25)
    fastest = max(r.value("decode_tok_s") or 0 for r in results.rows)
    new = Row("mlx:metal", "PyTorch", "Some new name", linnet=True,
              metrics={"decode_tok_s": Metric(2 * fastest)})
    sides = {title: ours for title, ours, _, _ in _sides(dataclasses.replace(results, rows=[*results.rows, new]))}
    assert sides["vs vLLM, one request"] == sides["vs the reference, in PyTorch"] == "mlx:metal"
    # A peer's row, however fast, is never Linnet's side.
    peer = dataclasses.replace(new, id="sglang", linnet=False)
    sides = {title: ours for title, ours, _, _ in _sides(dataclasses.replace(results, rows=[*results.rows, peer]))}
    assert sides["vs vLLM, one request"] == "jax:generated"


def test_a_cpu_run_has_the_cards_of_the_peers_it_ran():
    """A CPU run has llama.cpp, onnxruntime-genai and the HTTP servers where a GPU run has vLLM."""
    from pathlib import Path

    from linnet.site.subjects import canonical

    path = Path(__file__).parents[2] / "docs/results/qwen2.5-0.5b-instruct.shapes.epyc-2c.2026-12-01.cpu-small.json"
    sides = {title: (ours, theirs) for title, ours, theirs, _ in _sides(canonical(load_results(path)))}
    assert sides == {
        "vs llama.cpp, one request": ("torch:inductor@f16", "llama.cpp@f32"),
        "vs the reference, in PyTorch": ("torch:inductor@f16", "transformers:compiled@f32"),
        "vs KerasHub, in JAX": ("xla:stablehlo@f32", "keras-hub@f32"),
        "vs onnxruntime-genai, in ONNX Runtime": ("onnx:cpu@bf16", "onnxruntime-genai@f32"),
        "vs vLLM serve, over HTTP": ("serve:onnx:cpu", "vllm:serve"),
        "vs transformers serve, over HTTP": ("serve:onnx:cpu", "transformers:serve"),
    }
