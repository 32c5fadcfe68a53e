"""Render the Nestmodels site: an index of the registry and a page per model, as static HTML and CSS.

The output needs no server and no JavaScript: open ``index.html``. Each page links its registry entry
and its results files, copied beside it.
"""
from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2

from linnet import registry
from linnet.errors import ResultsError
from linnet.files import atomic_write, check_output
from linnet.results import GROUPS, METRICS, Results, Row, load_results
from linnet.site import charts, compare
from linnet.site import format as fmt
from linnet.site.cards import Card, cards

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Run:
    """One results file as a page shows it."""

    results: Results
    file: str  # its name under results/
    anchor: str  # its section's id on the page
    gpu: bool
    cards: list[Card]
    charts: list[charts.Chart]
    not_drawn: list[str]  # rows whose memory is a setting, named once each

    @property
    def rows_by_group(self) -> dict[str, list[Row]]:
        rows = self.results.rows
        return {g: [r for r in rows if r.group == g] for g in GROUPS if any(r.group == g for r in rows)}


def _title(metric: str, gpu: bool) -> str:
    return fmt.TITLES[metric] if gpu or metric != "peak_mem_gib" else "Peak memory"


def _run(results: Results, file: str, index: int) -> Run:
    gpu = results.machine.accelerator is not None
    drawn = [charts.chart(results, m, _title(m, gpu)) for m in METRICS]
    not_drawn = dict.fromkeys(r.name for r in results.rows if r.memory_is_setting and r.value("peak_mem_gib"))
    return Run(results, file, f"run-{index + 1}", gpu, cards(results), [c for c in drawn if c], list(not_drawn))


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.globals.update(fmt=fmt, METRICS=METRICS, title=_title, label=compare.label,
                       AXIS_HEIGHT=charts.AXIS_HEIGHT)
    return env


def _load(paths: Sequence[Path]) -> dict[str, list[tuple[Path, Results]]]:
    """Results by model id, oldest first; a results file for a model not in the registry is an error."""
    known = {e.id for e in registry.entries()}
    by_model: dict[str, list[tuple[Path, Results]]] = {}
    for path in paths:
        results = load_results(path)
        if results.model not in known:
            raise ResultsError(f"{path}: model: {results.model!r} is not in the registry "
                               f"(known: {', '.join(sorted(known))})")
        by_model.setdefault(results.model, []).append((Path(path), results))
    for runs in by_model.values():
        runs.sort(key=lambda pr: datetime.fromisoformat(pr[1].timestamp))
    return by_model


def render_site(paths: Sequence[Path], out: Path, force: bool = False) -> list[Path]:
    """Write the site for these results files as the directory ``out`` (replacing one that holds anything
    only with ``force``), whole or not at all; returns the pages written."""
    check_output(out, force)
    by_model = _load(paths)  # every results file is checked before anything is written
    pages: list[str] = []

    def write(tmp: Path) -> None:
        pages.extend(p.name for p in _write_site(by_model, tmp))

    atomic_write(out, write)
    return [out / name for name in pages]


def _write_site(by_model: dict[str, list[tuple[Path, Results]]], out: Path) -> list[Path]:
    env = _environment()
    out.mkdir()
    (out / "registry").mkdir(exist_ok=True)
    (out / "results").mkdir(exist_ok=True)
    shutil.copyfile(HERE / "style.css", out / "style.css")

    pages, index = [], []
    for entry in registry.entries():
        loaded = by_model.get(entry.id, [])
        for path, _ in loaded:
            shutil.copyfile(path, out / "results" / path.name)
        shutil.copyfile(registry.MODELS_DIR / f"{entry.id}.toml", out / "registry" / f"{entry.id}.toml")
        oldest_first = [r for _, r in loaded]
        # Newest first on the page; the side-by-side tables read left to right in time.
        runs = [_run(r, p.name, i) for i, (p, r) in enumerate(reversed(loaded))]
        page = out / f"{entry.id}.html"
        page.write_text(env.get_template("model.html.jinja").render(
            entry=entry, runs=runs, columns=oldest_first,
            comparison=compare.tables(oldest_first) if len(loaded) > 1 else []), encoding="utf-8")
        pages.append(page)
        index.append((entry, runs[0] if runs else None))
    (out / "index.html").write_text(env.get_template("index.html.jinja").render(models=index),
                                    encoding="utf-8")
    return [out / "index.html", *pages]


def bundled_results() -> list[Path]:
    """The published results that ship with Linnet."""
    return sorted(registry.RESULTS_DIR.glob("*.json"))

