"""The read bandwidth measured in the run, and the bytes a decode step reads, on tiny models."""
from __future__ import annotations

import io
import math

import pytest

from linnet.bench import bandwidth
from linnet.bench.harness import importable_here, worker_environment
from linnet.bench.protocol import Job
from linnet.errors import ResultsError
from linnet.gguf.export import export_gguf
from linnet.model import open_model
from linnet.registry.schema import Protocol
from linnet.results import Machine, Metric, Results, Row, from_data, to_data, validate

PROTOCOL = Protocol(prompt_tokens=16, new_tokens=8, batch=1, runs=2, warmups=1)
MIB = 2**20


def test_bandwidth_is_measured_in_a_process_like_the_workers():
    log = io.StringIO()
    samples = bandwidth.measure_apart(importable_here(worker_environment(1, "passive")), log,
                                      buffer_bytes=64 * MIB, passes=3)
    assert log.getvalue() == "linnet bench: measuring the read bandwidth ...\n" and len(samples) == 3
    assert all(math.isfinite(s) and 0.1 < s < 10_000 for s in samples)


def test_the_bandwidth_takes_turns_in_a_process_that_keeps_its_buffer():
    sampler = bandwidth.TurnSampler(importable_here(worker_environment(1, "passive")), buffer_bytes=64 * MIB,
                                    passes=2)
    try:
        turns = [sampler.sample() for _ in range(3)]
        process = sampler.process
    finally:
        sampler.close()
    assert [len(t) for t in turns] == [2, 2, 2]
    assert all(math.isfinite(s) and 0.1 < s < 10_000 for t in turns for s in t)
    assert process.returncode == 0  # its input closed, it ended on its own


def test_bandwidth_is_recorded_and_validated():
    row = Row("torch:eager", "PyTorch", "Linnet, generated PyTorch", linnet=True)
    results = Results("model", "2026-10-01T09:00:00+00:00", Machine(None, read_gb_s=Metric(20.0, [19.0, 20.0, 22.0])),
                      {}, PROTOCOL, [row])
    assert from_data(to_data(results)).machine.read_gb_s == Metric(20.0, [19.0, 20.0, 22.0])
    results.machine.read_gb_s = Metric(20.0, [19.0, -1.0])
    with pytest.raises(ResultsError, match=r"machine\.read_gb_s: -1\.0 is not a finite, positive number"):
        validate(results)


def test_bytes_per_token_of_a_tiny_model(checkpoint_dir):
    """Every weight the step multiplies by, plus the KV cache at the mean position, counted by hand."""
    model = open_model(str(checkpoint_dir("llama-gqa3")))  # an untied head: the embedding gives one row
    spec = model.spec
    assert not spec.tie_word_embeddings
    elements = sum(a.size for name, a in model.weights.items() if name != "embed") + spec.hidden_size
    reads = bandwidth.token_reads(spec, PROTOCOL, bandwidth.weights_in_dtype(spec, "bf16"), "f32")
    assert reads.weights == 2 * elements and reads.weight_type == "bf16"
    # Steps k = 1..7 read 16 + k positions: 20 on average, keys and values, every layer, f32.
    assert reads.position == 20
    assert reads.kv_cache == 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 20 * 4
    assert reads.total == reads.weights + reads.kv_cache
    note = reads.note(decode_tok_s=1000.0, bandwidth_gb_s=reads.total * 1000 / 1e9 * 4)
    assert note.endswith(f"{reads.total * 1000 / 1e9:.2f} GB/s, 25% of the read bandwidth measured in this run")


def test_a_tied_head_reads_the_whole_embedding(checkpoint_dir):
    model = open_model(str(checkpoint_dir("qwen2-tied")))
    spec = model.spec
    assert spec.tie_word_embeddings
    elements = sum(a.size for a in model.weights.values())
    assert bandwidth.weights_in_dtype(spec, "f32") == {"f32": 4 * elements}


def test_a_gguf_file_is_counted_as_stored(checkpoint_dir, tmp_path):
    model = open_model(str(checkpoint_dir("llama-gqa3")))
    spec = model.spec
    path = export_gguf(model, tmp_path / "m.gguf", "q8_0")
    by_type = bandwidth.weights_of_gguf(path, spec)
    expected: dict[str, int] = {}
    for name, a in model.weights.items():  # as export_gguf stores them: vectors in f32, matrices in q8_0
        kind, size = ("f32", 4) if a.ndim == 1 else ("f16", 2) if a.shape[-1] % 32 else ("q8_0", 34 / 32)
        elements = spec.hidden_size if name == "embed" else a.size  # the untied embedding gives one row
        expected[kind] = expected.get(kind, 0) + round(elements * size)
    assert by_type == expected and set(expected) == {"f32", "f16", "q8_0"}
    assert bandwidth.element_bytes("q4_1") == 20 / 32 and bandwidth.element_bytes("f16") == 2


EXPERT_PARTS = ("expert_gate", "expert_up", "expert_down")


@pytest.mark.parametrize("case", ["qwen2moe-shared-dense", "mixtral-top2of5"])
def test_a_mixture_of_experts_reads_top_k_of_its_experts(case, checkpoint_dir, tmp_path):
    """A decode token reads top_k of each sparse layer's experts, and all else whole: the router, the shared
    expert (Qwen2-MoE's), the dense layer among the sparse ones, attention; as stored in a GGUF file too."""
    model = open_model(str(checkpoint_dir(case)))
    spec, moe = model.spec, model.spec.moe
    share = moe.top_k / moe.experts  # 3 of 6, 2 of 5

    def read(name, elements):
        return elements * share if name.rsplit(".", 1)[-1] in EXPERT_PARTS else elements

    rows = 1 if not spec.tie_word_embeddings else spec.vocab_size  # an untied embedding gives one row
    elements = sum(read(name, a.size if name != "embed" else rows * spec.hidden_size)
                   for name, a in model.weights.items())
    assert bandwidth.weights_in_dtype(spec, "bf16") == {"bf16": round(2 * elements)}
    assert elements < spec.parameter_count() - (spec.vocab_size - rows) * spec.hidden_size
    if case == "mixtral-top2of5":  # a GGUF file of it, f32 throughout
        by_type = bandwidth.weights_of_gguf(export_gguf(model, tmp_path / "m.gguf", "f32"), spec)
        assert by_type == {"f32": round(4 * elements)}


def test_linnet_rows_read_the_cache_their_runner_keeps(checkpoint_dir, tmp_path):
    job = Job(str(checkpoint_dir("qwen2-tied")), "bf16", PROTOCOL, [1, 2, 3], str(tmp_path))
    spec = open_model(job.model).spec
    reports = {"torch:inductor": {"notes": [], "kv_cache_dtype": "bf16"},  # 16-bit weights, a 16-bit cache
               "onnx:cpu": {"notes": [], "kv_cache_dtype": "f32"},  # bfloat16 held in float32
               "transformers": {"notes": []}}
    reads = bandwidth.reads_of_subjects(job, spec, reports)
    assert {s: (r.weight_type, r.kv_type) for s, r in reads.items()} == {
        "torch:inductor": ("bf16", "bf16"), "onnx:cpu": ("bf16", "f32"), "transformers": ("bf16", "bf16")}
    assert 2 * reads["torch:inductor"].kv_cache == reads["onnx:cpu"].kv_cache > 0
    # a row that reports no cache (an older results file's worker): f32 on a CPU, the run's dtype on a GPU
    assert bandwidth.subject_reads("torch:eager", job, spec, accelerated=False).kv_type == "f32"
    assert bandwidth.subject_reads("torch:eager", job, spec, accelerated=True).kv_type == "bf16"


def test_a_linnet_row_running_a_gguf_files_blocks_reads_them_as_stored(checkpoint_dir, tmp_path):
    model = open_model(str(checkpoint_dir("llama-gqa3")))
    path = export_gguf(model, tmp_path / "m.gguf", "q8_0")
    job = Job(str(path), "f32", PROTOCOL, [1, 2, 3], str(tmp_path))
    reports = {"torch:inductor": {"notes": [f"{bandwidth.BLOCKS_NOTE} (q8_0), dequantised in the product's loop"]},
               "torch:eager": {"notes": []}}
    reads = bandwidth.reads_of_subjects(job, model.spec, reports)
    assert reads["torch:inductor"].weights == sum(bandwidth.weights_of_gguf(path, model.spec).values())
    assert set(reads["torch:inductor"].weight_type.split(", ")) == {"q8_0", "f32", "f16"}
    assert reads["torch:inductor"].kv_type == "f32"
    assert reads["torch:eager"].weight_type == "f32"  # widened to the run's dtype at load


def test_the_summary_shows_each_rows_share():
    reads = bandwidth.TokenReads(weights=90_000_000, weight_type="f32", kv_cache=10_000_000, kv_type="f32",
                                 position=576)
    row = Row("torch:eager", "PyTorch", "Linnet, generated PyTorch", linnet=True,
              metrics={"decode_tok_s": Metric(50.0)})
    bandwidth.add_notes([row], {"torch:eager": reads}, gb_s=20.0)
    assert row.notes == ["reads 100.00 MB per token (weights 90.00 MB in f32, KV cache 10.00 MB in f32 at 576 "
                         "positions on average): 5.00 GB/s, 25% of the read bandwidth measured in this run"]
    machine = Machine(None, read_gb_s=Metric(20.0, [18.0, 20.0, 21.0]))
    assert bandwidth.read_rate(row, machine) == "5.00 GB/s, 25%"
    assert bandwidth.measured(machine) == " · read bandwidth 20.0 GB/s (18.0-21.0 over 3 passes)"
