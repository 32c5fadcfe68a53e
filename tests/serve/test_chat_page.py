"""The chat page at ``/``: one HTML file with no external assets, and in headless Chromium (Debian's
``chromium``, as tests/site/test_browser.py runs it; skipped where it is absent) against a real server on a
tiny checkpoint with an API key: the key typed once, a streamed answer equal to the API's with its figures,
a cached prefix counted, the stop button, an API error shown, and a phone's width held."""
from __future__ import annotations

import re
import shutil
import time

import httpx
import pytest
from serve_helpers import CASE, running_server, wait_idle

from linnet.backends import CacheShape, create_runner
from linnet.model import open_model
from linnet.serve import Engine
from linnet.serve.app import create_app

NAME, KEY = "tiny-chat", "sesame"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    model = open_model(str(checkpoint_dir(CASE)))
    engine = Engine(create_runner("torch:eager", model.weights, CacheShape(2, 256)), model.tokenizer)
    with running_server(create_app(engine, NAME, api_key=KEY)) as url:
        yield engine, url


def test_the_page_is_one_file_with_no_external_urls(server):
    response = httpx.get(server[1] + "/")  # no key: the page holds no secret
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html = response.text
    assert "<title>Linnet chat</title>" in html and "v1/chat/completions" in html
    assert not re.search(r"""(src|href|url)\s*[=(]\s*["']?(https?:)?//""", html, re.IGNORECASE)
    assert "http://" not in html and "https://" not in html
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html)  # nothing to fetch but the API


def test_the_page_in_a_browser(server, monkeypatch):
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (apt-get install chromium)")
    engine, url = server
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 390, "height": 800})  # a phone's width
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/")
            expect = sync_api.expect
            expect(page.locator("#status")).to_contain_text("needs an API key")
            expect(page.get_by_role("button", name="Send")).to_be_disabled()

            page.get_by_label("API key").fill(KEY)
            page.get_by_label("API key").dispatch_event("change")
            expect(page.locator("#model")).to_have_text(NAME)
            page.reload()  # the key is kept for the tab (sessionStorage)
            expect(page.locator("#model")).to_have_text(NAME)

            page.locator("summary", has_text="Settings").click()  # closed again after the reload
            page.get_by_label("System prompt").fill("Answer briefly.")
            page.get_by_label("Temperature").fill("0")
            page.get_by_label("Max tokens").fill("12")
            page.get_by_label("Message").fill("Hello there")
            page.get_by_label("Message").press("Enter")
            answer = page.locator("article.assistant").nth(0)
            expect(answer.locator(".figures")).to_contain_text("prompt tokens cached")
            messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello there"}]
            want = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json={
                "model": NAME, "max_tokens": 12, "temperature": 0, "top_p": 1, "messages": messages}).json()
            assert answer.locator(".text").inner_text() == want["choices"][0]["message"]["content"]
            tokens, prompt = want["usage"]["completion_tokens"], want["usage"]["prompt_tokens"]
            assert tokens > 1  # else no rate to show
            figures = answer.locator(".figures").inner_text()
            assert re.fullmatch(rf"first token \d+ ms · [\d.]+ tokens/s · {tokens} tokens · 0 of {prompt} prompt "
                                "tokens cached", figures), figures

            page.get_by_label("Message").fill("And then?")  # the conversation so far is a cached prefix
            page.get_by_role("button", name="Send").click()
            second = page.locator("article.assistant").nth(1).locator(".figures")
            expect(second).to_contain_text("prompt tokens cached")
            cached = int(re.search(r"(\d+) of \d+ prompt tokens cached", second.inner_text()).group(1))
            assert cached > 0

            # Stop: each step made slow, so the answer is still streaming when the button is pressed.
            step = engine.runner.step
            monkeypatch.setattr(engine.runner, "step", lambda *a, **k: (time.sleep(0.05), step(*a, **k))[1])
            page.get_by_label("Max tokens").fill("100")
            page.get_by_label("Message").fill("Go on at length")
            page.get_by_role("button", name="Send").click()
            third = page.locator("article.assistant").nth(2)
            expect(third.locator(".text")).not_to_have_text("")
            page.get_by_role("button", name="Stop").click()
            expect(third.locator(".figures")).to_contain_text("stopped")
            expect(page.get_by_role("button", name="Stop")).to_be_disabled()
            monkeypatch.undo()
            wait_idle(engine)  # the aborted stream freed its row
            assert engine.metrics.requests["cancelled"] >= 1

            page.get_by_label("Max tokens").fill("100000")  # more than a row holds: the API's 400
            page.get_by_label("Message").fill("Too much")
            page.get_by_role("button", name="Send").click()
            expect(page.get_by_role("alert")).to_contain_text("but max_tokens is 100000")

            layout = page.evaluate("() => [document.documentElement.scrollWidth, window.innerWidth]")
            assert layout[0] <= layout[1] == 390
            assert errors == []
        finally:
            browser.close()
