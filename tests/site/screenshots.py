"""Screenshots of a rendered site for review, taken with the Chromium the browser tests use.

    .venv/bin/python tests/site/screenshots.py docs/measured-site docs/site-screenshots

writes ``index.png``, ``model.png`` (Qwen2.5 0.5B Instruct's page) and ``history.png`` (its history): 1280 px
wide, 1400 px of each page (the whole of a long page would be megabytes in git): the top of the index
and of the model page, and the history from its first group of runs that shows changes.
"""
from __future__ import annotations

import sys
from pathlib import Path

from playwright.sync_api import sync_playwright
from test_browser import ARGS, CHROMIUM

MODEL = "qwen2.5-0.5b-instruct"
# Each page, and where its screenshot starts: the history's at its first group of runs with changes.
SHOTS = {"index.png": ("index.html", None), "model.png": (f"{MODEL}.html", None),
         "history.png": (f"{MODEL}--history.html", ".protocol-group:has(.change)")}
HEIGHT = 1400
WIDTH = 1280


def main(site: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": WIDTH, "height": 900})
        for name, (html, start) in SHOTS.items():
            page.goto((site / html).as_uri())
            box = page.locator(start).first.bounding_box() if start else None
            clip = {"x": 0, "y": box["y"] - 16 if box else 0, "width": WIDTH, "height": HEIGHT}
            page.screenshot(path=str(out / name), full_page=True, clip=clip)
            print(f"{out / name}: {(out / name).stat().st_size // 1024} KiB")
        browser.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]))
