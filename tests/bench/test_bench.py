"""linnet bench on a tiny checkpoint: real worker processes, a real reference, a tiny protocol."""
from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from linnet.backends import registry
from linnet.backends.registry import BackendPackage, get_backend
from linnet.bench import worker
from linnet.bench.harness import (
    Settings,
    add_comparisons,
    distance_from_reference,
    make_row,
    run_bench,
    run_turns,
    worker_environment,
)
from linnet.bench.protocol import Job, random_prompt
from linnet.bench.table import format_results
from linnet.commands import bench
from linnet.errors import LinnetError
from linnet.registry.schema import Protocol
from linnet.results import METRICS, Machine, Results, load_results, validate

pytest.importorskip("transformers")

PROTOCOL = Protocol(prompt_tokens=16, new_tokens=8, batch=1, runs=2, warmups=1)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


@pytest.fixture(scope="module")
def run(checkpoint_dir, tmp_path_factory):
    """One bench: transformers (the reference), Linnet eager, and CUDA graphs (not run without a GPU)."""
    out = tmp_path_factory.mktemp("bench") / "results.json"
    args = parse([
        str(checkpoint_dir("qwen2-tied")), "--peer", "transformers", "--backend", "torch:eager",
        "--backend", "torch:cudagraphs", "--prompt-tokens", "16", "--new-tokens", "8", "--warmup", "1",
        "--runs", "2", "--threads", "1", "-o", str(out),
    ])
    code = bench.handle(args)
    return code, load_results(out)


def test_every_metric_is_measured(run):
    code, results = run
    assert code == 0
    for row_id in ("transformers", "torch:eager"):
        row = results.find(row_id)
        assert row.not_run is None and set(row.metrics) == set(METRICS) - {"serve_tok_s", "serve_ttft_ms"}
        assert all(m.value > 0 for m in row.metrics.values())
        assert len(row.metrics["ttft_ms"].samples) == len(row.metrics["decode_tok_s"].samples) == 2
    assert results.protocol == PROTOCOL


def test_distance_from_the_reference(run):
    _, results = run
    assert results.find("transformers").distance == "reference"
    linnet = results.find("torch:eager")
    assert (linnet.name, linnet.group, linnet.linnet) == ("Linnet, generated PyTorch", "PyTorch", True)
    assert isinstance(linnet.distance, float) and linnet.distance < 1e-3
    assert linnet.against.row == "transformers" and linnet.against.metric == "decode_tok_s"
    # keys and values of 2 layers, 2 KV heads of 12, 128 positions, f32
    assert f"KV cache compiled for 128 positions, {2 * 2 * 2 * 12 * 128 * 4} bytes a row in f32" in linnet.notes


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA graphs run where there is a GPU")
def test_cuda_graphs_is_not_run_without_a_gpu(run):
    _, results = run
    row = results.find("torch:cudagraphs")
    assert row.not_run == get_backend("torch:cudagraphs").unavailable() and not row.metrics


def test_threads_and_load_average_are_recorded(run):
    _, results = run
    assert results.machine.threads == 1 and len(results.machine.load_average) == 3
    assert results.machine.cpu and results.versions["transformers"]
    for row in results.rows:
        if row.not_run is None:
            assert "1 thread, OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=1000" in row.notes
            assert any(n.startswith("load average ") and " before, " in n for n in row.notes)
            assert "runs interleaved with the other subjects'" in row.notes


def test_subjects_take_turns(checkpoint_dir, tmp_path: Path):
    """Each subject's i-th generation runs between the other's i-th and (i+1)-th, all in live workers; what
    runs between the rounds (the bench's bandwidth samples) runs after each timed round, not the warm-ups."""
    job = Job(str(checkpoint_dir("qwen2-tied")), "f32", PROTOCOL, random_prompt(331, 16), str(tmp_path))
    job.save(tmp_path / "job.json")
    log = io.StringIO()
    rounds: list[float] = []
    reports = run_turns(tmp_path / "job.json", ["transformers", "torch:eager"], worker_environment(1, "passive"),
                        PROTOCOL, log, between=lambda: rounds.append(time.time()))
    first, second = reports["transformers"]["started"], reports["torch:eager"]["started"]
    assert len(first) == len(second) == PROTOCOL.warmups + PROTOCOL.runs
    assert all(a < b for a, b in zip(first, second)) and all(b < a for b, a in zip(second, first[1:]))
    timed = second[PROTOCOL.warmups:]
    assert len(rounds) == PROTOCOL.runs and all(b < r for b, r in zip(timed, rounds))
    assert all(r < a for r, a in zip(rounds, first[PROTOCOL.warmups + 1:]))
    assert all(len(r["decode_tok_s"]) == PROTOCOL.runs and "peak_memory" in r for r in reports.values())
    assert "generation 1 of 3 (warm-up): transformers, torch:eager" in log.getvalue()


def test_spinning_workers_cannot_take_turns(checkpoint_dir):
    settings = Settings(str(checkpoint_dir("qwen2-tied")), ("torch:eager",), PROTOCOL, omp_wait_policy="active")
    with pytest.raises(LinnetError, match="OMP_WAIT_POLICY=ACTIVE .* run them in sequence"):
        run_bench(settings)
    assert parse(["model", "--sequential"]).sequential and not parse(["model"]).sequential


def test_distance_stops_where_the_greedy_tokens_part(tmp_path: Path):
    job = Job("unused", "f32", PROTOCOL, [1, 2, 3], str(tmp_path))
    ref = np.zeros((5, 4), np.float32)
    mine = ref.copy()
    mine[1] += 0.25  # the step after the first token, fed the same token by both
    mine[2:] += 9.0  # inputs differ from here on: not compared
    np.save(job.logits_path("transformers"), ref)
    np.save(job.logits_path("torch:eager"), mine)
    reports = {"transformers": {"tokens": [7, 3, 5, 5, 5]}, "torch:eager": {"tokens": [7, 1, 5, 5, 5]}}
    assert distance_from_reference(job, "torch:eager", reports) == (0.25, 2)
    reports["torch:eager"]["tokens"] = [7, 3, 5, 5, 5]
    assert distance_from_reference(job, "torch:eager", reports) == (9.0, 5)


def test_transformers_missing_is_not_run(tmp_path: Path, monkeypatch, capsys):
    job = Job("unused", "f32", PROTOCOL, [1, 2, 3], str(tmp_path))
    job.save(tmp_path / "job.json")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "linnet.bench.peers", raising=False)
    worker.main([str(tmp_path / "job.json"), "transformers"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["not_run"].startswith("transformers is not installed")


def test_transformers_decodes_every_token_even_past_eos(checkpoint_dir, tmp_path: Path):
    """A checkpoint whose EOS is the first greedy token still yields new_tokens tokens."""
    from linnet.bench.peers import TransformersSubject

    source = checkpoint_dir("qwen2-tied")
    job = Job(str(source), "f32", PROTOCOL, random_prompt(331, 16), str(tmp_path))
    subject = TransformersSubject(False, job)
    subject.load()
    first = subject.generate(job.prompt, 1, record=1).tokens[0]
    subject.model.config.eos_token_id = first
    subject.model.generation_config.eos_token_id = first
    g = subject.generate(job.prompt, 8, record=3)
    assert len(g.tokens) == 8 and g.tokens[0] == first and g.logits.shape == (3, 331)
    assert g.ttft_s > 0 and g.decode_s > 0


def test_the_parent_reads_only_the_spec(checkpoint_dir, tmp_path: Path):
    from linnet.gguf.export import export_gguf
    from linnet.model import open_model, open_spec

    source = checkpoint_dir("qwen2-tied")
    model = open_model(str(source))
    gguf = export_gguf(model, tmp_path / "m.gguf", "f16")
    assert open_spec(str(source)) == model.spec and open_spec(str(gguf)).vocab_size == model.spec.vocab_size


def test_random_prompt():
    prompt = random_prompt(331, 64)
    assert prompt == random_prompt(331, 64) and all(0 <= t < 331 for t in prompt) and len(set(prompt)) > 32


def test_a_crash_is_a_failed_row_not_an_estimate(tmp_path: Path, capsys):
    job = Job(str(tmp_path / "no-such-model"), "f32", PROTOCOL, [1, 2, 3], str(tmp_path))
    job.save(tmp_path / "job.json")
    worker.main([str(tmp_path / "job.json"), "torch:eager"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["not_run"].startswith("failed: ") and "ttft_s" not in report


def test_compiled_subjects_are_set_up_before_the_load_clock(checkpoint_dir, tmp_path: Path):
    """In a fresh interpreter, so that no earlier test has imported the compiler already."""
    import subprocess

    job = Job(str(checkpoint_dir("qwen2-tied")), "f32", PROTOCOL, [1, 2, 3], str(tmp_path))
    job_path = tmp_path / "job.json"
    job.save(job_path)
    script = f"""
import sys
from pathlib import Path
from linnet.backends.registry import get_backend
from linnet.bench.protocol import Job
from linnet.bench.backends import LinnetSubject
from linnet.bench.peers import TransformersSubject
job = Job.load(Path({str(job_path)!r}))
assert "torch._inductor.compile_fx" not in sys.modules
LinnetSubject(get_backend("torch:inductor"), job)
assert "torch._dynamo" in sys.modules and "torch._inductor.compile_fx" in sys.modules
assert TransformersSubject(True, job).options["cache_implementation"] == "static"
assert TransformersSubject(False, job).options == {{}}
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


# A backend package made up here: nothing outside the registry names it, so if the bench finds its rows,
# their names and group, it found them by id.
def fake_unavailable(mode: str) -> str | None:
    return "the fake accelerator is switched off" if mode == "off" else None


FAKE = BackendPackage(name="fake", modes=(("fast", "Fakery, fast"), ("off", "Fakery, off")), dtypes=("f32",),
                      group="JAX", runner=f"{__name__}:NoRunner", check=f"{__name__}:fake_unavailable")


@pytest.fixture
def fake_backend(monkeypatch):
    packages = (*registry.packages(), FAKE)
    monkeypatch.setattr(registry, "packages", lambda: packages)


def _report(decode_tok_s: float) -> dict:
    """A worker's report of one finished subject, as run_turns gathers it."""
    return {"ttft_s": [0.01], "decode_tok_s": [decode_tok_s], "load_s": 1.0, "peak_memory": 2**30,
            "load_average": [0.1, 0.2], "notes": [], "threads": 1, "openmp": "OMP_WAIT_POLICY=PASSIVE",
            "first_generation_s": 0.5, "tokens": [1, 2]}


def test_a_new_backend_package_is_benched_without_edits_elsewhere(fake_backend):
    commands = argparse.ArgumentParser().add_subparsers()
    bench.register(commands)
    assert "fake:fast" in commands.choices["bench"].format_help()
    assert parse(["model", "--backend", "fake:fast"]).backend == ["fake:fast"]
    assert {"fake:fast", "fake:off", "torch:eager", "transformers"} <= set(bench.subjects(parse(["model"])))
    rows = [make_row("transformers", _report(100.0), None, True),
            make_row("fake:fast", _report(150.0), (1e-4, 2), True),
            make_row("fake:off", {"not_run": "the fake accelerator is switched off"}, None, True)]
    add_comparisons(rows)
    _, fast, off = rows
    assert (fast.id, fast.name, fast.group, fast.linnet) == ("fake:fast", "Fakery, fast", "JAX", True)
    assert fast.against.row == "transformers" and fast.against.ratio == pytest.approx(1.5)
    assert (off.name, off.not_run, off.metrics) == ("Fakery, off", "the fake accelerator is switched off", {})
    results = Results("model", "2026-10-01T09:00:00+00:00", Machine(None), {}, PROTOCOL, rows)
    validate(results)
    printed = format_results(results).splitlines()
    assert ["Fakery,", "fast", "1.50×", "1.00×", "1.00×"] in [line.split() for line in printed]  # vs transformers
    assert "Fakery, off: not run: the fake accelerator is switched off" in printed


def test_a_backend_that_cannot_run_here_is_not_run_with_its_reason(fake_backend, tmp_path: Path, capsys):
    job = Job("unused", "f32", PROTOCOL, [1, 2, 3], str(tmp_path))
    assert worker.open_subject("fake:fast", job).backend.display == "Fakery, fast"
    worker.serve("fake:off", job, io.StringIO(""), load_only=True)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["not_run"] == "the fake accelerator is switched off" and "load_s" not in report
    job = Job("unused", "bf16", PROTOCOL, [1, 2, 3], str(tmp_path))
    worker.serve("fake:fast", job, io.StringIO(""), load_only=True)
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["not_run"] == "fake:fast does not run bf16; it runs f32"
