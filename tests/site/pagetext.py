"""Reading rendered pages back as text, the way the seed pages were dumped, and each chart's parts."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser

RED = "#d7263d"


def squash(text: str) -> str:
    """Text without whitespace: element boundaries add spaces in one dump and not in another."""
    return re.sub(r"\s+", "", text)


@dataclass
class Chart:
    caption: str
    groups: list[str] = field(default_factory=list)
    ticks: list[str] = field(default_factory=list)
    bars: list[tuple[str, str]] = field(default_factory=list)  # (name, value) in drawing order
    red: list[str] = field(default_factory=list)  # the names of the rows whose bar is red


class Page(HTMLParser):
    def __init__(self, html: str):
        super().__init__()
        self.texts: list[str] = []  # the body's text, in document order
        self.charts: list[Chart] = []
        self._in_body = False
        self._caption: list[str] | None = None  # while inside a figcaption
        self._last_caption = ""
        self._text_class: str | None = None  # while inside an SVG <text>
        self._row = ""
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self._in_body = True
        elif tag == "figcaption":
            self._caption = []
        elif tag == "svg" and "chart" in (a.get("class") or "").split():
            self.charts.append(Chart(self._last_caption))
        elif tag == "text":
            self._text_class = a.get("class")
        elif tag == "rect" and (a.get("fill") or "").lower() == RED:
            self.charts[-1].red.append(self._row)

    def handle_endtag(self, tag):
        if tag == "figcaption":
            self._last_caption, self._caption = " ".join("".join(self._caption).split()), None
        elif tag == "text":
            self._text_class = None

    def handle_data(self, data):
        if not self._in_body:
            return
        self.texts.append(data)
        if self._caption is not None:
            self._caption.append(data)
        if self._text_class is None:
            return
        chart = self.charts[-1]
        if self._text_class == "tick":
            chart.ticks.append(data)
        elif self._text_class == "group":
            chart.groups.append(data)
        elif self._text_class == "name":
            self._row = data
        elif self._text_class == "value":
            chart.bars.append((self._row, data))

    @property
    def text(self) -> str:
        return " ".join(self.texts)
