"""llama.cpp as a bench peer: real worker processes running llama-cpp-python on tiny GGUF files."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from linnet.bench import worker
from linnet.bench.harness import Settings, run_bench
from linnet.bench.protocol import Job
from linnet.bench.table import format_results
from linnet.gguf.export import export_gguf
from linnet.model import open_model
from linnet.registry.schema import Protocol

PROTOCOL = Protocol(prompt_tokens=16, new_tokens=8, batch=1, runs=2, warmups=1)


@pytest.mark.slow  # ~40 s on a busy 2-core machine: a whole bench, with an export and a bandwidth measurement
@pytest.mark.llamacpp
def test_llama_cpp_runs_the_export_beside_the_reference(checkpoint_dir):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    pytest.importorskip("transformers")
    settings = Settings(str(checkpoint_dir("qwen2-tied")), ("transformers", "llama.cpp", "torch:eager"),
                        PROTOCOL, threads=1)
    results = run_bench(settings, log=io.StringIO())
    row = results.find("llama.cpp")
    assert row.not_run is None and (row.name, row.group, row.linnet) == ("llama.cpp", "LLM engines", False)
    assert all(m.value > 0 for m in row.metrics.values()) and len(row.metrics["decode_tok_s"].samples) == 2
    # f32 weights and cache on both sides, only the summation order differs (tests/gguf/test_llamacpp.py)
    assert isinstance(row.distance, float) and row.distance < 1e-3
    assert "weights f32 (exported from the Hugging Face directory in f32)" in row.notes
    assert {"KV cache f32", "flash attention off", "1 thread, OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=1000"
            } <= set(row.notes)
    linnet = results.find("torch:eager")
    assert linnet.against.row in ("transformers", "llama.cpp")
    # 5 passes before the turns and 5 after each round of timed runs (bandwidth.TurnSampler)
    assert results.machine.read_gb_s.value > 0 and len(results.machine.read_gb_s.samples) == 5 * (1 + PROTOCOL.runs)
    for r in (row, linnet, results.find("transformers")):
        assert any(n.startswith("reads ") and "of the read bandwidth measured in this run" in n for n in r.notes)
    printed = format_results(results)
    assert "read bandwidth" in printed and "Reads" in printed and "vs llama.cpp" in printed


@pytest.mark.llamacpp
def test_a_gguf_file_runs_as_it_is(checkpoint_dir, tmp_path: Path, capsys):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    path = export_gguf(open_model(str(checkpoint_dir("qwen2-tied"))), tmp_path / "m.gguf", "f16")
    job = Job(str(path), "f32", PROTOCOL, [1, 2, 3, 4], str(tmp_path))
    subject = worker.open_subject("llama.cpp", job)
    subject.load()
    g = subject.generate(job.prompt, 6, record=2)
    assert len(g.tokens) == 6 and g.logits.shape == (2, 331) and g.ttft_s > 0 and g.decode_s > 0
    assert g.tokens[0] == int(g.logits[0].argmax()) and g.tokens[1] == int(g.logits[1].argmax())
    assert subject.generate(job.prompt, 6, record=0).tokens == g.tokens  # the cache is reset between runs
    assert subject.notes()[:2] == ["weights f16, f32 (the GGUF file as it is)", "KV cache f16"]
    assert not list(tmp_path.glob("llama.cpp-*.gguf"))  # nothing exported


def test_llama_cpp_missing_is_not_run(tmp_path: Path, monkeypatch, capsys):
    job = Job("unused.gguf", "f32", PROTOCOL, [1, 2, 3], str(tmp_path))
    job.save(tmp_path / "job.json")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ModuleNotFoundError
    worker.main([str(tmp_path / "job.json"), "llama.cpp"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["not_run"] == "llama-cpp-python is not installed (pip install llama-cpp-python)"
