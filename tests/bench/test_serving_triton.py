"""The serving benchmark's Triton subject: a real tritonserver hosting linnet.serve on the repository that
`linnet triton` writes, driven through Triton's HTTP generate_stream beside `linnet serve`, on a tiny
checkpoint and a tiny profile."""
from __future__ import annotations

import io

import pytest

from linnet.bench.serving import ServingProfile, serving_results, serving_rows
from linnet.results import load_results, save_results
from linnet.site.render import render_site
from linnet.triton import server

CASE = "qwen2-tied"
TINY = ServingProfile("tiny", requests=6, prompt_min=4, prompt_max=12, new_tokens=5, concurrency=3)
ALONE, HOSTED = "linnet:torch:eager", "triton:torch:eager"


@pytest.mark.slow  # starts linnet serve and tritonserver, each loading torch: about 25 s
def test_triton_rows_sit_beside_linnet_serve_and_render(checkpoint_dir, tmp_path):
    reason = server.missing()
    if reason:
        pytest.skip(reason)
    results = serving_results(str(checkpoint_dir(CASE)), "smollm2-135m-instruct", [ALONE, HOSTED], TINY, "f32", 1,
                              io.StringIO())
    save_results(results, tmp_path / "serving.json")  # validates the whole file
    alone, hosted = load_results(tmp_path / "serving.json").rows
    assert hosted.not_run is None, hosted.not_run
    assert hosted.id == "triton:linnet:torch:eager" and hosted.linnet
    assert hosted.name.startswith("Triton hosting linnet.serve")
    assert set(hosted.metrics) == {"serve_tok_s", "serve_ttft_ms", "load_s", "peak_mem_gib"}
    assert len(hosted.metrics["serve_ttft_ms"].samples) == TINY.requests
    assert "30 tokens returned (6 x 5)" in hosted.notes  # the engine's own counts, from the last responses
    assert not any(note.startswith("counted") for note in hosted.notes)  # the same prompt ids as linnet serve's
    assert any("generate_stream" in note for note in hosted.notes)
    assert any(note.startswith("inter-token latency") for note in hosted.notes)
    ratio = hosted.value("serve_tok_s") / alone.value("serve_tok_s")
    assert hosted.against.row == "serve:torch:eager" and hosted.against.ratio == pytest.approx(ratio, abs=1e-3)
    render_site([tmp_path / "serving.json"], tmp_path / "site")
    page = (tmp_path / "site" / "smollm2-135m-instruct.html").read_text()
    assert "Triton, linnet.serve backend, generated PyTorch" in page  # the page's name for the subject


def test_without_the_stub_environment_the_triton_row_is_not_run(checkpoint_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(server, "STUB_ENV", tmp_path / "no-stub")
    row, = serving_rows(str(checkpoint_dir(CASE)), [HOSTED], TINY, "f32", 1, io.StringIO())
    assert row.id == "triton:linnet:torch:eager" and not row.metrics
    no_stub = f"no Python-backend stub environment at {tmp_path / 'no-stub'} (docs/TRITON.md, 'Running it')"
    assert row.not_run in (no_stub, "tritonserver is not installed (pip install --no-deps nvidia-pytriton==0.7.0)")
