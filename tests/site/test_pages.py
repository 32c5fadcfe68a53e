"""The rendered pages carry everything the seed pages show, formatted as there.

The seed pages (tests/site/data/*.seed.txt) are text dumps of two finished pages. Every line of them
must appear in the rendered page, in order, whitespace aside; each chart must show the seed's groups,
ticks, bars and values in the seed's order. The few places where the pages differ on purpose are in
DELIBERATE, each with its reason.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from pagetext import Page, squash

from linnet import registry
from linnet.commands import site as site_command
from linnet.results import Machine, Row, load_results, save_results
from linnet.site import format as fmt
from linnet.site.render import bundled_results, render_site

DATA = Path(__file__).parent / "data"
SEEDS = {"qwen3-4b": DATA / "qwen3-4b.seed.txt", "qwen2.5-0.5b-instruct": DATA / "qwen2.5-0.5b-instruct.seed.txt"}

DELIBERATE = {
    # The registry holds the count of the checkpoint's weights (494,032,768); the seed's 494.5M is no count.
    "494.5M parameters": "494M parameters",
    # Three significant figures: the seed printed a fourth for a value just under ten.
    "10.00 GiB": "10.0 GiB",
    # Notes sit on a line under their row, so the table has no Notes column.
    "Distance from referenceNotes": "Distance from reference",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    render_site(bundled_results(), out)
    return out


def _seed_lines(model: str) -> list[str]:
    text = SEEDS[model].read_text(encoding="utf-8")
    for seed, ours in DELIBERATE.items():
        text = text.replace(seed, ours)
    return [line.strip().removeprefix("•").strip() for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("model", SEEDS)
def test_every_line_of_the_seed_is_on_the_page_in_order(site: Path, model: str):
    page = squash(Page((site / f"{model}.html").read_text()).text)
    lines = _seed_lines(model)
    at = 0
    for previous, line in zip([""] + lines, lines):
        if "the best bar is red." in previous or "Not drawn" in line:
            continue  # a chart's text, or the list of rows not drawn: checked below, part by part
        found = page.find(squash(line), at)
        assert found >= 0, f"not on the page (after position {at}): {line!r}"
        at = found + len(squash(line))


@pytest.mark.parametrize("model", SEEDS)
def test_charts_show_the_seed_bars_ticks_and_groups(site: Path, model: str):
    charts = Page((site / f"{model}.html").read_text()).charts
    lines = _seed_lines(model)
    seed_charts = [line for previous, line in zip(lines, lines[1:]) if "the best bar is red." in previous]
    assert len(charts) == len(seed_charts) == 6
    for chart, seed in zip(charts, seed_charts):
        drawn = "".join(chart.groups) + "".join(chart.ticks) + "".join(n + v for n, v in chart.bars)
        assert squash(drawn) == squash(seed)


@pytest.mark.parametrize("model", SEEDS)
def test_the_best_bar_is_the_red_one(site: Path, model: str):
    for chart in Page((site / f"{model}.html").read_text()).charts:
        values = {name: float(value.split()[0].replace(",", "")) for name, value in chart.bars}
        best = (min if "lower is better" in chart.caption else max)(values.values())
        assert len(chart.red) == 1 and values[chart.red[0]] == best, chart.caption


@pytest.mark.parametrize("model", SEEDS)
def test_rows_whose_memory_is_a_setting_are_listed_not_drawn(site: Path, model: str):
    page = Page((site / f"{model}.html").read_text())
    memory = page.charts[-1]
    seed = next(line for line in _seed_lines(model) if "Not drawn" in line)
    seed_names = seed.split("rather than a need: ")[1].removesuffix(" (in the table).")
    ours = memory.caption.split("rather than a need: ")[1].removesuffix(" (in the table).").split("; ")
    for name in sorted(ours, key=len, reverse=True):  # longest first: "vLLM" is inside other names
        assert name in seed_names
        seed_names = seed_names.replace(name, "")
    assert seed_names.strip(", ") == "", "the seed lists rows the page does not"
    assert not set(ours) & {name for name, _ in memory.bars}


def test_index_lists_the_registry_with_headline_ratios(site: Path):
    text = Page((site / "index.html").read_text()).text
    for entry in registry.entries():
        assert entry.name in text and (site / f"{entry.id}.html").is_file()
        assert (site / "registry" / f"{entry.id}.toml").read_text() == (
            registry.MODELS_DIR / f"{entry.id}.toml").read_text()
        card = squash(text[text.index(entry.name):])
        assert card.startswith(squash(entry.name)) and squash(f"{fmt.parameters(entry.parameters)} parameters") in card
        assert all(squash(tag) in card for tag in entry.tags)
    smol = squash(text[text.index("SmolLM2 135M Instruct"):])
    assert smol.startswith(squash("SmolLM2 135M Instruct")) and "Notmeasuredyet" in smol[:600]
    qwen25 = squash(text[text.index("Qwen2.5 0.5B Instruct"):text.index("Qwen3 4B")])
    assert squash("Measured on NVIDIA H100 80GB HBM3 · published History · 1 run") in qwen25
    assert squash("1.49× vs vLLM, one request") in qwen25
    assert squash("\u221227.9% exported to vLLM, SGLang, TGI") in qwen25


def test_a_model_not_measured_yet_has_its_registry_facts_and_the_command(site: Path):
    entry = registry.find("smollm2-135m-instruct")
    text = squash(Page((site / f"{entry.id}.html").read_text()).text)
    assert squash("Not measured yet") in text and not (site / f"{entry.id}--history.html").exists()
    assert squash(f"linnet bench {entry.id} --all -o results/") in text
    assert squash(f"{entry.hf.repo}, revision {entry.hf.revision}") in text
    assert squash(f"Parameters {entry.parameters:,}") in text


def test_pages_need_no_server_and_no_scripts(site: Path):
    for page in site.glob("*.html"):
        html = page.read_text()
        assert "<script" not in html
        for link in re.findall(r'(?:href|src)="([^"#]+)"', html):
            assert link.startswith("https://") or (site / link).is_file(), f"{page.name}: {link}"


def _with_rows(tmp_path: Path, name: str, **changes) -> Path:
    results = load_results(registry.RESULTS_DIR / "qwen2.5-0.5b-instruct.h100-2026-09-28.json")
    results = dataclasses.replace(results, **changes)
    path = tmp_path / name
    save_results(results, path)
    return path


def test_a_row_not_run_shows_its_reason(tmp_path: Path):
    base = load_results(registry.RESULTS_DIR / "qwen2.5-0.5b-instruct.h100-2026-09-28.json")
    sglang = Row("sglang", "LLM engines", "SGLang", not_run="needs CUDA 13")
    path = _with_rows(tmp_path, "r.json", rows=[*base.rows, sglang])
    render_site([path], tmp_path / "out")
    page = Page((tmp_path / "out" / "qwen2.5-0.5b-instruct.html").read_text())
    assert squash("SGLang not run: needs CUDA 13 not compared") in squash(page.text)
    assert all("SGLang" not in name for chart in page.charts for name, _ in chart.bars)


def _scaled(results, k: float) -> list[Row]:
    return [dataclasses.replace(r, metrics={m: dataclasses.replace(v, value=v.value * k) for m, v in r.metrics.items()})
            for r in results.rows]


def test_each_machine_kind_has_its_page_and_no_change_crosses_kinds(tmp_path: Path):
    base = load_results(registry.RESULTS_DIR / "qwen2.5-0.5b-instruct.h100-2026-09-28.json")
    h200 = _with_rows(tmp_path, "h200.json", rows=_scaled(base, 2), timestamp="2026-10-01T09:00:00+00:00",
                      machine=dataclasses.replace(base.machine, accelerator="NVIDIA H200"))
    render_site([h200, *bundled_results()], tmp_path / "out")
    out = tmp_path / "out"
    # Linnet's own run leads; the published one is a kind of its own, on a page of its own.
    own = Page((out / "qwen2.5-0.5b-instruct.html").read_text())
    published = Page((out / "qwen2.5-0.5b-instruct--nvidia-h100-80gb-hbm3-published.html").read_text())
    assert squash("NVIDIA H200 · 512 prompt tokens") in squash(own.text)
    assert "1,816tok/s" in squash(own.text) and "908tok/s" not in squash(own.text)
    assert squash("NVIDIA H100 80GB HBM3 · 512 prompt tokens") in squash(published.text)
    assert len(own.charts) == len(published.charts) == 6
    for page in (own, published):
        assert squash("NVIDIA H200 NVIDIA H100 80GB HBM3 · published History · 2 runs") in squash(page.text)
    history = squash(Page((out / "qwen2.5-0.5b-instruct--history.html").read_text()).text)
    assert "%" not in history.split(squash("Every results file"))[1]  # one run per kind: nothing to change from


def test_the_history_shows_changes_within_a_kind_and_protocol(tmp_path: Path):
    base = load_results(registry.RESULTS_DIR / "qwen2.5-0.5b-instruct.h100-2026-09-28.json")
    before = _with_rows(tmp_path, "before.json")
    after = _with_rows(tmp_path, "after.json", rows=_scaled(base, 2), timestamp="2026-10-01T09:00:00+00:00")
    other = _with_rows(tmp_path, "other.json", timestamp="2026-10-02T09:00:00+00:00",
                       protocol=dataclasses.replace(base.protocol, runs=3))
    render_site([after, before, other], tmp_path / "out", force=True)
    out = tmp_path / "out"
    history = squash(Page((out / "qwen2.5-0.5b-instruct--history.html").read_text()).text)
    assert squash("Linnet, CUDA graphs 908 tok/s 1,816 tok/s +100.0%") in history
    # The later run under another protocol is the one shown, and its own group in the history.
    shown = squash(Page((out / "qwen2.5-0.5b-instruct.html").read_text()).text)
    assert squash("median of 3 runs after 3 warm-ups") in shown
    assert history.index(squash("median of 3 runs")) < history.index(squash("median of 10 runs"))
    assert squash("superseded (move it to archive/)") in history  # before.json: after.json measured all of it again


def test_results_of_a_model_outside_the_registry_get_pages_of_their_own(tmp_path: Path):
    """``linnet bench -o`` writes results for any model: the site draws its pages from the results alone,
    named after a safe form of its id, with none of what only a registry entry holds."""
    path = _with_rows(tmp_path, "r.json", model="My Org/GPT 9")
    render_site([path], tmp_path / "out")
    out = tmp_path / "out"
    page = Page((out / "unlisted-my-org-gpt-9.html").read_text())
    assert squash("My Org/GPT 9 Not in Linnet's registry") in squash(page.text)
    assert len(page.charts) == 6 and "Registry entry" not in page.text
    assert (out / "results" / "r.json").is_file() and not (out / "registry" / "unlisted-my-org-gpt-9.toml").exists()
    index = (out / "index.html").read_text()
    assert 'href="unlisted-my-org-gpt-9.html"' in index and "registry/unlisted" not in index


def test_site_command_renders_the_bundled_results(tmp_path: Path, capsys):
    args = type("Args", (), {"results": [], "output": tmp_path / "out", "force": False, "without_published": False})()
    assert site_command.handle(args) == 0
    published = {"qwen2.5-0.5b-instruct", "qwen3-4b"}
    assert {p.name for p in (tmp_path / "out").glob("*.html")} == {
        "index.html", *(f"{e.id}.html" for e in registry.entries()), *(f"{m}--history.html" for m in published)}
    assert len(list((tmp_path / "out" / "results").glob("*.json"))) == 2
    assert f"wrote {len(registry.entries()) + 3} pages" in capsys.readouterr().out


def test_site_command_reads_the_archive_beside_the_results(tmp_path: Path):
    (tmp_path / "archive").mkdir()
    current, old = tmp_path / "a.json", tmp_path / "archive" / "b.json"
    for path in (current, old):
        save_results(load_results(registry.RESULTS_DIR / "qwen3-4b.h100-2026-09-28.json"), path)
    assert site_command.results_files([tmp_path], published=False) == [current, old]


DOCS = Path(__file__).parents[2] / "docs"


def _same_tree(rendered: Path, committed: Path, command: str) -> None:
    files = sorted(p.relative_to(rendered) for p in rendered.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(committed) for p in committed.rglob("*") if p.is_file())
    for name in files:
        assert (rendered / name).read_bytes() == (committed / name).read_bytes(), (
            f"{committed.relative_to(DOCS.parent)}/{name} is stale: run `{command}`")


@pytest.mark.skipif(not (DOCS / "site").is_dir(), reason="no committed site beside these tests")
def test_the_committed_site_is_current(site: Path):
    _same_tree(site, DOCS / "site", "linnet site -o docs/site")


@pytest.mark.skipif(not (DOCS / "measured-site").is_dir(), reason="no committed measured site beside these tests")
def test_the_committed_site_of_measured_results_is_current(tmp_path: Path):
    """docs/measured-site: the results measured on the development VMs (docs/results/) beside the published."""
    render_site(site_command.results_files([DOCS / "results"], published=True), tmp_path / "out")
    _same_tree(tmp_path / "out", DOCS / "measured-site", "linnet site docs/results -o docs/measured-site")


def test_a_cpu_run(tmp_path: Path):
    """A run without an accelerator: its CPU leads the protocol line and memory is not the GPU's."""
    base = load_results(registry.RESULTS_DIR / "qwen2.5-0.5b-instruct.h100-2026-09-28.json")
    cpu = Machine(accelerator=None, cpu="AMD EPYC 7B13, 2 cores", memory_gib=7.8, threads=2,
                  load_average=[0.12, 0.3, 0.41])
    path = _with_rows(tmp_path, "cpu.json", machine=cpu, rows=[r for r in base.rows if r.group == "PyTorch"])
    render_site([path], tmp_path / "out")
    page = Page((tmp_path / "out" / "qwen2.5-0.5b-instruct.html").read_text())
    text = squash(page.text)
    assert squash("AMD EPYC 7B13, 2 cores · 512 prompt tokens, 128 new") in text
    assert squash("2 threads · 7.80 GiB memory · load average 0.12, 0.3, 0.41") in text
    assert "PeakGPUmemory" not in text and squash("Peak memory") in text
    assert squash("vs the reference, in PyTorch 4.81× faster") in text
    assert "vsvLLM" not in text  # no card for a peer that has no row


def test_a_kind_without_a_complete_run_shows_its_latest_marked_partial(tmp_path: Path):
    base = load_results(registry.RESULTS_DIR / "qwen2.5-0.5b-instruct.h100-2026-09-28.json")
    serving = [dataclasses.replace(r, against=None) for r in base.rows if r.group == "Serving many requests"]
    path = _with_rows(tmp_path, "m.epyc-avx2-2c.json", rows=serving,
                      machine=Machine(accelerator=None, cpu="AMD EPYC, 2 cores", threads=2))
    render_site([path], tmp_path / "out")
    text = squash(Page((tmp_path / "out" / "qwen2.5-0.5b-instruct.html").read_text()).text)
    assert squash("No complete run on this machine kind yet") in text
    assert squash("this is its latest run, of 9 rows") in text
    assert squash("Machine kind AMD EPYC (AVX2): the run recorded 'AMD EPYC, 2 cores'; its vector units are read "
                  "from its file's name ('avx2')") in text
