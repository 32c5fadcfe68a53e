"""KerasHub (JAX) as a bench peer: its own compiled generate on tiny checkpoints, against transformers.

KerasHub 0.32's converters load the tiny Qwen2 and Qwen3 checkpoints; the two Llama cases are refused by
name (head_dim other than hidden / heads; attention biases, which it would drop without an error).
"""
from __future__ import annotations

import importlib.util
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
# Looked up, not imported: keras must first be imported by linnet.bench.peers_keras, which picks its backend.
needs_keras_hub = pytest.mark.skipif(importlib.util.find_spec("keras_hub") is None,
                                     reason="keras-hub is not installed")


def job_for(directory: Path, tmp_path: Path) -> Job:
    return Job(str(directory), "f32", PROTOCOL, random_prompt(331, PROTOCOL.prompt_tokens), str(tmp_path))


@needs_keras_hub
@pytest.mark.parametrize("case", ["qwen2-tied", "qwen3-mqa-tied"])
def test_keras_hub_decodes_as_the_reference(case, checkpoint_dir, tmp_path: Path):
    pytest.importorskip("transformers")
    job = job_for(checkpoint_dir(case), tmp_path)
    reference = worker.open_subject("transformers", job)
    reference.load()
    expected = reference.generate(job.prompt, 8, record=3)
    subject = worker.open_subject("keras-hub", job)
    subject.load()
    g = subject.generate(job.prompt, 8, record=3)
    assert g.tokens == expected.tokens and g.ttft_s > 0 and g.decode_s > 0
    assert g.logits.shape == (3, 331) and g.logits.dtype == np.float32
    np.testing.assert_allclose(g.logits, expected.logits, atol=1e-4)  # f32 on both sides
    again = subject.generate(job.prompt, 8, record=0)  # the same compiled loop, no logits kept
    assert again.tokens == g.tokens and again.logits is None
    assert subject.peak_memory() > 0 and subject.notes()[0].endswith("KV cache of 24 positions")


@needs_keras_hub
def test_a_llama_it_loads_says_which_epsilon_it_normalises_with(tmp_path: Path):
    """KerasHub 0.32's Llama converter leaves rms_norm_eps at its own 1e-6 (SmolLM2's is 1e-5): the row says so."""
    from checkpoints import BASE, Case, build_checkpoint

    config = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5)
    directory = build_checkpoint(Case("llama-eps", "LlamaForCausalLM", config), tmp_path / "llama")
    job = job_for(directory, tmp_path)
    subject = worker.open_subject("keras-hub", job)
    subject.load()
    g = subject.generate(job.prompt, 4, record=1)
    assert len(g.tokens) == 4 and g.logits.shape == (1, BASE["vocab_size"])
    assert "KerasHub's model normalises with epsilon 1e-06, the checkpoint's is 1e-05: part of its distance" \
        in subject.notes()


@needs_keras_hub
@pytest.mark.parametrize("case, reason", [
    ("llama-gqa3", "KerasHub's Llama model takes head_dim = hidden_size / heads = 8; this checkpoint's is 16"),
    ("llama-mqa-tied-rope3", "KerasHub's Llama converter drops the attention biases this checkpoint has"),
])
def test_checkpoints_kerashub_would_misload_are_not_run(case, reason, checkpoint_dir, tmp_path: Path):
    with pytest.raises(BackendUnavailable) as e:
        worker.open_subject("keras-hub", job_for(checkpoint_dir(case), tmp_path))
    assert str(e.value) == reason


@needs_keras_hub
def test_a_gguf_file_is_not_run(tmp_path: Path):
    with pytest.raises(BackendUnavailable, match="KerasHub loads Hugging Face directories; m.gguf is not one"):
        worker.open_subject("keras-hub", Job("m.gguf", "f32", PROTOCOL, [1, 2], str(tmp_path)))


def test_keras_hub_missing_is_not_run(tmp_path: Path, monkeypatch, capsys):
    job = Job("unused", "f32", PROTOCOL, [1, 2, 3], str(tmp_path))
    job.save(tmp_path / "job.json")
    monkeypatch.delitem(sys.modules, "linnet.bench.peers_keras", raising=False)  # imported afresh below
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # import keras_hub raises ModuleNotFoundError
    worker.main([str(tmp_path / "job.json"), "keras-hub"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["not_run"].startswith("KerasHub cannot be imported (import of keras_hub halted")
    assert "pip install --no-deps keras-hub keras" in report["not_run"]


@needs_keras_hub
@pytest.mark.slow  # a whole bench: worker processes each importing KerasHub, and an XLA compile of generate
def test_keras_hub_is_a_row_of_the_bench(checkpoint_dir):
    pytest.importorskip("transformers")
    settings = Settings(str(checkpoint_dir("qwen2-tied")), ("transformers", "keras-hub", "torch:eager"),
                        PROTOCOL, threads=1)
    results = run_bench(settings, log=QUIET)
    row = results.find("keras-hub")
    assert row.not_run is None and (row.name, row.group, row.linnet) == ("KerasHub", "JAX", False)
    assert all(m.value > 0 for m in row.metrics.values()) and len(row.metrics["decode_tok_s"].samples) == 2
    assert isinstance(row.distance, float) and row.distance < 1e-4
    assert any(n.startswith("reads ") for n in row.notes)
