"""The pages in a real browser: headless Chromium at phone and laptop widths.

Needs the Python playwright package and Debian's chromium (``apt-get install chromium``); playwright's
own browser downloads are not used.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from linnet.results import METRICS
from linnet.site.render import bundled_results, render_site

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)")

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = ["index.html", "qwen2.5-0.5b-instruct.html", "qwen3-4b.html"]
# One round trip to the browser for every measurement.
LAYOUT = """() => ({
  scrollWidth: document.documentElement.scrollWidth,
  innerWidth: window.innerWidth,
  tableOverflow: document.querySelector('.scroll') && getComputedStyle(document.querySelector('.scroll')).overflowX,
  charts: [...document.querySelectorAll('svg.chart')].map(svg => {
    const r = svg.getBoundingClientRect();
    const style = getComputedStyle(svg);
    return {left: r.left, right: r.right, width: r.width, height: r.height,
            visible: style.visibility === 'visible' && style.display !== 'none'};
  }),
})"""


@pytest.fixture(scope="module")
def chromium():
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def browser(chromium, tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    render_site(bundled_results(), site)
    return chromium, site


@pytest.mark.parametrize("width", [390, 1280])
@pytest.mark.parametrize("name", PAGES)
def test_layout_holds(browser, tmp_path: Path, name: str, width: int):
    chromium, site = browser
    page = chromium.new_page(viewport={"width": width, "height": 900})
    try:
        page.goto((site / name).as_uri())
        layout = page.evaluate(LAYOUT)
        assert layout["scrollWidth"] <= layout["innerWidth"] == width
        for box in layout["charts"]:  # each chart shown, with a size, inside the window
            assert box["visible"] and box["width"] > 0 and box["height"] > 0
            assert box["left"] >= 0 and box["right"] <= width
        if name.startswith("qwen"):
            assert len(layout["charts"]) == 6
            assert layout["tableOverflow"] == "auto"  # the wide table scrolls in its own box, not the page
        shot = tmp_path / f"{name}-{width}.png"
        page.screenshot(path=str(shot))  # the first screenful: a full page takes seconds
        assert shot.stat().st_size > 10_000
    finally:
        page.close()


# The measured site: Linnet's own runs (docs/results, and its archive for the history) beside the published.
MEASURED = ["qwen2.5-0.5b-instruct", "smollm2-135m-instruct"]
# Per table: its columns, and the machine kinds its columns or its run come from; per change shown, the kind
# and protocol of its column and of the column before it; per chart, its caption and bars.
DOM = """() => ({
  kinds: [...document.querySelectorAll('.run[data-kind]')].map(e => e.dataset.kind),
  tables: [...document.querySelectorAll('table')].map(t => {
    const head = [...t.querySelectorAll('thead th')];
    const run = t.closest('[data-kind]');
    return {columns: head.length, kinds: head.filter(th => th.dataset.kind).map(th => th.dataset.kind),
            runKind: run ? run.dataset.kind : null};
  }),
  changes: [...document.querySelectorAll('td .change')].map(span => {
    const td = span.closest('td'), head = [...td.closest('table').querySelectorAll('thead th')];
    const [mine, before] = [head[[...td.parentElement.children].indexOf(td)], head[+span.dataset.since]];
    return [mine.dataset.kind, mine.dataset.protocol, before.dataset.kind, before.dataset.protocol];
  }),
  figures: [...document.querySelectorAll('figure')].map(f => ({
    caption: f.querySelector('figcaption').textContent,
    bars: [...f.querySelectorAll('svg.chart g.row')].map(g => ({
      value: parseFloat(g.querySelector('.value').textContent.replace(/,/g, '')),
      best: g.classList.contains('best'), fill: getComputedStyle(g.querySelector('rect')).fill})),
  })),
})"""
RED = "rgb(215, 38, 61)"


@pytest.fixture(scope="module")
def measured(chromium, tmp_path_factory):
    from linnet.commands.site import results_files

    site = tmp_path_factory.mktemp("measured")
    render_site(results_files([Path(__file__).parents[2] / "docs" / "results"], published=True), site)
    return chromium, site


def _dom(chromium, page_path: Path, width: int = 1280) -> dict:
    page = chromium.new_page(viewport={"width": width, "height": 900})
    try:
        page.goto(page_path.as_uri())
        return {**page.evaluate(DOM), **page.evaluate(LAYOUT)}
    finally:
        page.close()


@pytest.mark.parametrize("model", MEASURED)
def test_a_model_page_shows_one_machine_kind_and_every_chart_marks_its_best_bar(measured, model: str):
    chromium, site = measured
    pages = sorted(site.glob(f"{model}.html")) + sorted(site.glob(f"{model}--*.html"))
    kind_pages = [p for p in pages if not p.name.endswith("--history.html")]
    assert len(kind_pages) >= 3  # two CPU kinds at least, and the published H100
    for path in kind_pages:
        dom = _dom(chromium, path)
        assert len(dom["kinds"]) == 1, path.name  # one machine kind shown, one run in full
        for table in dom["tables"]:
            # At most one column per machine kind shown: the metrics, never a column per results file.
            assert table["columns"] <= 1 + len(METRICS) + 2, path.name
            assert len(table["kinds"]) == len(set(table["kinds"])) and set(table["kinds"]) <= set(dom["kinds"])
            assert table["runKind"] in dom["kinds"], path.name
        assert dom["changes"] == [], path.name  # a model page computes no change at all
        assert dom["figures"], path.name
        for chart in dom["figures"]:
            best = (min if "lower is better" in chart["caption"] else max)(b["value"] for b in chart["bars"])
            red = [b for b in chart["bars"] if b["fill"] == RED]
            assert [b["best"] for b in chart["bars"]].count(True) == 1 and len(red) == 1, path.name
            assert red[0]["best"] and red[0]["value"] == best, (path.name, chart["caption"])


@pytest.mark.parametrize("model", MEASURED)
def test_the_history_computes_changes_only_within_a_kind_and_protocol(measured, model: str):
    chromium, site = measured
    dom = _dom(chromium, site / f"{model}--history.html")
    assert len(dom["changes"]) > 10  # the Xeon's and the EPYC's repeated serving runs
    for mine_kind, mine_protocol, before_kind, before_protocol in dom["changes"]:
        assert mine_kind and mine_protocol and (mine_kind, mine_protocol) == (before_kind, before_protocol)
    for table in dom["tables"]:
        assert len(set(table["kinds"])) == 1


@pytest.mark.parametrize("width", [390, 1280])
@pytest.mark.parametrize("name", ["index.html", "qwen2.5-0.5b-instruct.html", "qwen2.5-0.5b-instruct--history.html",
                                  "smollm2-135m-instruct--intel-xeon-unknown-vector-units.html", "pythia-1b.html"])
def test_the_measured_pages_fit_phone_and_laptop(measured, name: str, width: int):
    chromium, site = measured
    layout = _dom(chromium, site / name, width)
    assert layout["scrollWidth"] <= layout["innerWidth"] == width
