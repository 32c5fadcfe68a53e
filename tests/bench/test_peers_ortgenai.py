"""onnxruntime-genai as a bench peer: its model builder's fp32 model of tiny checkpoints, against transformers.

Its CPU GroupQueryAttention kernel needs a head size that is a multiple of 8: of the tiny checkpoints,
llama-gqa3 (16), qwen3-gqa3 (32) and qwen3-mqa-tied (16) run; qwen2-tied and llama-mqa-tied-rope3 (12) are
refused by name.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from linnet.bench import worker
from linnet.bench.harness import Settings, run_bench
from linnet.bench.protocol import Job, random_prompt
from linnet.errors import BackendUnavailable
from linnet.registry.schema import Protocol

PROTOCOL = Protocol(prompt_tokens=16, new_tokens=8, batch=1, runs=2, warmups=1)
QUIET = open("/dev/null", "w")


def job_for(directory: Path, tmp_path: Path, dtype: str = "f32") -> Job:
    return Job(str(directory), dtype, PROTOCOL, random_prompt(331, PROTOCOL.prompt_tokens), str(tmp_path))


@pytest.mark.parametrize("case", ["llama-gqa3", "qwen3-gqa3"])
def test_onnxruntime_genai_decodes_as_the_reference(case, checkpoint_dir, tmp_path: Path):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    pytest.importorskip("transformers")
    job = job_for(checkpoint_dir(case), tmp_path)
    reference = worker.open_subject("transformers", job)
    reference.load()
    expected = reference.generate(job.prompt, 8, record=3)
    subject = worker.open_subject("onnxruntime-genai", job)  # runs the builder, once per checkpoint
    built = subject.path / "model.onnx"
    assert built.is_file() and subject.path.parent.name.startswith("linnet-cache")  # the session's cache
    subject.load()
    g = subject.generate(job.prompt, 8, record=3)
    assert g.tokens == expected.tokens and g.ttft_s > 0 and g.decode_s > 0
    assert g.logits.shape == (3, 331) and g.logits.dtype == np.float32
    np.testing.assert_allclose(g.logits, expected.logits, atol=1e-4)  # f32 on both sides
    again = subject.generate(job.prompt, 8, record=0)  # a fresh generator: the cache starts empty
    assert again.tokens == g.tokens and again.logits is None
    mtime = built.stat().st_mtime_ns
    assert worker.open_subject("onnxruntime-genai", job).path == subject.path  # cached: not built again
    assert built.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("case, dtype, reason", [
    ("qwen2-tied", "f32",
     "ONNX Runtime's GroupQueryAttention on the CPU needs a head size that is a multiple of 8; this model's is 12"),
    ("qwen3-mqa-tied", "bf16", "onnxruntime-genai's builder makes fp32 models for the CPU (or int8, int4), not bf16"),
])
def test_what_it_cannot_run_is_not_run(case, dtype, reason, checkpoint_dir, tmp_path: Path):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    from linnet.bench.peers_ortgenai import model_dir

    job = job_for(checkpoint_dir(case), tmp_path, dtype)
    with pytest.raises(BackendUnavailable) as e:
        worker.open_subject("onnxruntime-genai", job)
    assert str(e.value) == reason
    assert not model_dir(job).exists()  # refused before the builder runs


def test_onnxruntime_genai_missing_is_not_run(tmp_path: Path, monkeypatch, capsys):
    job = Job("unused", "f32", PROTOCOL, [1, 2, 3], str(tmp_path))
    job.save(tmp_path / "job.json")
    monkeypatch.delitem(sys.modules, "linnet.bench.peers_ortgenai", raising=False)  # imported afresh below
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import raises ModuleNotFoundError
    worker.main([str(tmp_path / "job.json"), "onnxruntime-genai"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["not_run"] == ("onnxruntime-genai is not installed "
                                 "(pip install --no-deps onnxruntime-genai, beside onnxruntime)")


@pytest.mark.slow  # a whole bench: the builder, worker processes, a bandwidth measurement
def test_onnxruntime_genai_is_a_row_of_the_bench(checkpoint_dir):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    pytest.importorskip("transformers")
    settings = Settings(str(checkpoint_dir("llama-gqa3")), ("transformers", "onnxruntime-genai", "onnx:cpu"),
                        PROTOCOL, threads=1)
    results = run_bench(settings, log=QUIET)
    row = results.find("onnxruntime-genai")
    assert row.not_run is None
    assert (row.name, row.group, row.linnet) == ("onnxruntime-genai", "ONNX Runtime and TensorRT", False)
    assert all(m.value > 0 for m in row.metrics.values()) and len(row.metrics["decode_tok_s"].samples) == 2
    assert isinstance(row.distance, float) and row.distance < 1e-4
    assert "1 intra-op thread" in row.notes and any(n.startswith("reads ") for n in row.notes)
