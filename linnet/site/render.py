"""Render the Nestmodels site: an index of the registry and, per model, a page per machine kind and a history,
as static HTML and CSS.

The output needs no server and no JavaScript: open ``index.html``. A model's ``<id>.html`` shows the current
evidence on its first machine kind (``linnet.site.runs`` says which run and in what order), ``<id>--<kind>.html``
each other kind's, and ``<id>--history.html`` every run. Pages link their registry entry and results files,
copied beside them (superseded ones under ``results/archive/``).
"""
from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2

from linnet import registry
from linnet.files import atomic_write, check_output
from linnet.registry.schema import Entry
from linnet.results import GROUPS, METRICS, Results, Row, load_results
from linnet.site import charts, compare, runs
from linnet.site import format as fmt
from linnet.site.cards import Card, cards
from linnet.site.machines import Kind
from linnet.site.unlisted import unlisted_entry

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Section:
    """A run in full, as the seed pages show theirs: the cards, a chart per metric and every number."""

    run: runs.Run
    cards: list[Card]
    charts: list[charts.Chart]
    not_drawn: list[str]  # rows whose memory is a setting, named once each

    @property
    def results(self) -> Results:
        return self.run.results

    @property
    def gpu(self) -> bool:
        return self.run.kind.gpu

    @property
    def rows_by_group(self) -> dict[str, list[Row]]:
        rows = self.results.rows
        return {g: [r for r in rows if r.group == g] for g in GROUPS if any(r.group == g for r in rows)}


def _title(metric: str, gpu: bool) -> str:
    return fmt.TITLES[metric] if gpu or metric != "peak_mem_gib" else "Peak memory"


def _section(run: runs.Run) -> Section:
    results, gpu = run.results, run.kind.gpu
    drawn = [charts.chart(results, m, _title(m, gpu)) for m in METRICS]
    not_drawn = dict.fromkeys(r.name for r in results.rows if r.memory_is_setting and r.value("peak_mem_gib"))
    return Section(run, cards(results), [c for c in drawn if c], list(not_drawn))


@dataclass(frozen=True)
class Tab:
    file: str
    text: str


@dataclass(frozen=True)
class Model:
    """A registry entry's pages: one per machine kind with a current run, and its history."""

    entry: Entry
    loaded: list[runs.Run]  # every run of it, current and archived
    kinds: list[runs.KindRuns]  # in page order
    listed: bool = True  # in the registry; else an entry made from its results alone (linnet.site.unlisted)

    @property
    def shown(self) -> list[runs.KindRuns]:
        return [k for k in self.kinds if k.lead]

    def page(self, kind: Kind) -> str:
        """The first kind's page is the model's own; the others carry the kind's name."""
        first = self.shown[0].kind if self.shown else None
        return f"{self.entry.id}.html" if kind == first else f"{self.entry.id}--{kind.slug}.html"

    @property
    def history(self) -> str:
        return f"{self.entry.id}--history.html"

    @property
    def tabs(self) -> list[Tab]:
        tabs = [Tab(self.page(k.kind), k.kind.name) for k in self.shown]
        return [*tabs, Tab(self.history, f"History · {fmt.count(len(self.loaded), 'run')}")] if self.loaded else tabs


def _status(kind: runs.KindRuns, run: runs.Run) -> str:
    if run is kind.lead:
        return "shown on the model page"
    if run in kind.current:
        return "current"
    return "superseded, archived" if run.archived else "superseded (move it to archive/)"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.globals.update(fmt=fmt, METRICS=METRICS, GROUPS=GROUPS, title=_title, tables=compare.tables, status=_status,
                       AXIS_HEIGHT=charts.AXIS_HEIGHT)
    return env


def _load(paths: Sequence[Path]) -> dict[str, list[tuple[Path, Results]]]:
    """Results by model id, oldest first."""
    by_model: dict[str, list[tuple[Path, Results]]] = {}
    for path in paths:
        results = load_results(path)
        by_model.setdefault(results.model, []).append((Path(path), results))
    for loaded in by_model.values():
        loaded.sort(key=lambda pr: datetime.fromisoformat(pr[1].timestamp))
    return by_model


def render_site(paths: Sequence[Path], out: Path, force: bool = False) -> list[Path]:
    """Write the site for these results files as the directory ``out`` (replacing one that holds anything
    only with ``force``), whole or not at all; returns the pages written."""
    check_output(out, force)
    models = _models(_load(paths))  # every results file is checked before anything is written
    pages: list[str] = []

    def write(tmp: Path) -> None:
        pages.extend(p.name for p in _write_site(models, tmp))

    atomic_write(out, write)
    return [out / name for name in pages]


def _models(by_model: dict[str, list[tuple[Path, Results]]]) -> list[Model]:
    """Every registry entry with its runs, read as runs of machine kinds; the published ones marked so."""
    published = {p.resolve() for p in bundled_results()}
    models = []
    for entry in registry.entries():
        loaded = [runs.run(p, r, p.resolve() in published) for p, r in by_model.get(entry.id, [])]
        models.append(Model(entry, loaded, runs.by_kind(loaded)))
    taken = {m.entry.id for m in models}
    for model_id in sorted(set(by_model) - taken):  # results of a model outside the registry: pages of their own
        loaded = [runs.run(p, r, p.resolve() in published) for p, r in by_model[model_id]]
        entry = unlisted_entry(model_id, by_model[model_id][-1][1], taken)
        models.append(Model(entry, loaded, runs.by_kind(loaded), listed=False))
    return models


def _write_site(models: list[Model], out: Path) -> list[Path]:
    env = _environment()
    out.mkdir()
    (out / "registry").mkdir()
    shutil.copyfile(HERE / "style.css", out / "style.css")

    def page(name: str, template: str, **values: object) -> Path:
        (out / name).write_text(env.get_template(template).render(**values), encoding="utf-8")
        return out / name

    pages = []
    for model in models:
        entry = model.entry
        for run in model.loaded:
            (out / run.link).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(run.path, out / run.link)
        if model.listed:
            shutil.copyfile(registry.MODELS_DIR / f"{entry.id}.toml", out / "registry" / f"{entry.id}.toml")
        for kind in model.shown:
            pages.append(page(model.page(kind.kind), "model.html.jinja", model=model, kind=kind,
                              section=_section(kind.lead) if kind.lead else None))
        if not model.shown:
            pages.append(page(f"{entry.id}.html", "model.html.jinja", model=model, kind=None, section=None))
        if model.loaded:
            pages.append(page(model.history, "history.html.jinja", model=model))
    index = [(m, _section(m.shown[0].lead) if m.shown and m.shown[0].lead else None) for m in models]
    return [page("index.html", "index.html.jinja", models=index), *pages]


def bundled_results() -> list[Path]:
    """The published results that ship with Linnet."""
    return sorted(registry.RESULTS_DIR.glob("*.json"))

