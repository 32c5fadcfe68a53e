"""The chat page at ``/``: one HTML file (``chat.html``, its CSS and JavaScript inline, no external
assets) that talks to the server's own ``/v1`` API from the browser."""
from __future__ import annotations

from functools import cache
from importlib.resources import files

from starlette.responses import HTMLResponse


@cache
def chat_html() -> str:
    return files("linnet.serve").joinpath("chat.html").read_text(encoding="utf-8")


def chat_page() -> HTMLResponse:
    """The page; open without an API key (it holds no secret: the key is typed into it, and only its API
    calls send it)."""
    return HTMLResponse(chat_html(), headers={"Cache-Control": "no-cache"})
