"""Machine kinds, which run leads a kind's page, and which runs are superseded."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from linnet import registry
from linnet.results import Machine, load_results
from linnet.site import runs
from linnet.site.machines import kind

DOCS_RESULTS = Path(__file__).parents[2] / "docs" / "results"
QWEN25 = registry.RESULTS_DIR / "qwen2.5-0.5b-instruct.h100-2026-09-28.json"
EPYC = Machine(accelerator=None, cpu="AMD EPYC, 2 cores", threads=2)


@pytest.mark.parametrize("cpu, file, label, recorded", [
    ("AMD EPYC (AVX2), 2 cores", "m.epyc-2c.json", "AMD EPYC (AVX2)", True),  # the file name is not read then
    ("Intel Xeon (AVX-512, AMX), 2 cores", "m.json", "Intel Xeon (AVX-512, AMX)", True),
    ("AMD EPYC, 2 cores", "m.shapes.epyc-avx2-2c.2026-12-04.serving.json", "AMD EPYC (AVX2)", False),
    ("AMD EPYC, 2 cores", "m.epyc-2c.2026-12-01.json", "AMD EPYC (unknown vector units)", False),
    ("Intel(R) Xeon(R) Processor, 2 cores", "m.xeon-2c.2026-12-02.json", "Intel Xeon (unknown vector units)", False),
])
def test_a_cpu_kind_is_its_vector_units(cpu: str, file: str, label: str, recorded: bool):
    found, note = kind(Machine(accelerator=None, cpu=cpu), file)
    assert found.label == label and not found.gpu
    assert (note is None) == recorded  # a note says how the units were read where the run did not record them


def test_a_gpu_kind_is_its_model_and_published_is_a_kind_of_its_own():
    h100 = Machine(accelerator="NVIDIA H100 80GB HBM3")
    measured, published = kind(h100, "a.json")[0], kind(h100, "a.json", published=True)[0]
    assert measured.gpu and measured != published
    assert (measured.name, published.name) == ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3 · published")
    assert published.slug == "nvidia-h100-80gb-hbm3-published"


def _run(name: str, when: str, ids: list[str] | None = None, **changes) -> runs.Run:
    base = load_results(QWEN25)
    rows = base.rows if ids is None else [dataclasses.replace(r, against=None) for r in base.rows if r.id in ids]
    results = dataclasses.replace(base, timestamp=f"2026-12-{when}:00+00:00", machine=EPYC, rows=rows, **changes)
    return runs.run(Path("docs") / name, results)


def test_a_run_is_superseded_once_later_runs_measured_all_its_subjects():
    old = _run("a.json", "01T10:00", ["vllm", "torch:inductor"])
    half = _run("b.json", "02T10:00", ["vllm"])
    other_protocol = _run("c.json", "03T10:00", ["torch:inductor"],
                          protocol=dataclasses.replace(load_results(QWEN25).protocol, runs=3))
    assert runs.superseded([old, half, other_protocol]) == set()
    rest = _run("d.json", "04T10:00", ["torch:inductor", "transformers"])
    assert runs.superseded([old, half, other_protocol, rest]) == {old.path}
    assert runs.superseded([rest, _run("e.json", "05T10:00", ["torch:inductor"])]) == set()


def test_a_kind_leads_with_its_latest_complete_run():
    complete = _run("full.json", "01T10:00")
    partial = _run("serving.json", "02T10:00", ["vllm:batched", "serve:torch:cudagraphs"])
    (epyc,) = runs.by_kind([complete, partial])
    assert epyc.lead is complete and complete.complete and not partial.complete
    (alone,) = runs.by_kind([partial])
    assert alone.lead is partial  # no complete run: the latest, which the page marks partial
    # without a complete run, the broadest leads: rows in three groups, not a later serving load alone
    broad = _run("engines.json", "01T12:00", ["transformers", "keras-hub", "torch:inductor", "vllm"])
    assert broad.groups == 3 and partial.groups == 1
    assert runs.by_kind([broad, partial])[0].lead is broad
    archived = dataclasses.replace(complete, archived=True)
    assert runs.by_kind([archived, partial])[0].lead is partial


def test_kinds_are_ordered_measured_first_then_complete_then_newest():
    published = runs.run(QWEN25, load_results(QWEN25), published=True)
    epyc = _run("full.json", "01T10:00")
    avx2 = _run("x.epyc-avx2-2c.json", "04T10:00", ["serve:torch:cudagraphs"])
    assert [k.kind.name for k in runs.by_kind([published, avx2, epyc])] == [
        "AMD EPYC (unknown vector units)", "AMD EPYC (AVX2)", "NVIDIA H100 80GB HBM3 · published"]


def test_the_committed_results_keep_superseded_runs_in_the_archive():
    """docs/results/ holds the current runs; a run superseded since belongs in docs/results/archive/."""
    files = [*DOCS_RESULTS.glob("*.json"), *DOCS_RESULTS.glob("archive/*.json")]
    loaded = [runs.run(p, load_results(p)) for p in files]
    stale = sorted(p.name for p in runs.superseded(loaded) if p.parent == DOCS_RESULTS)
    assert stale == [], f"superseded: mv them to {DOCS_RESULTS / runs.ARCHIVE}/"
    assert all(r.archived for r in loaded if r.path.parent.name == runs.ARCHIVE)
