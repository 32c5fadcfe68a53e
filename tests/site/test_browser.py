"""The pages in a real browser: headless Chromium at phone and laptop widths.

Needs the Python playwright package and Debian's chromium (``apt-get install chromium``); playwright's
own browser downloads are not used.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

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
def browser(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    render_site(bundled_results(), site)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield browser, site
        browser.close()


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
