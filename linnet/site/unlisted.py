"""A model outside the registry, known only from its results files (``linnet bench -o`` and ``bench-serve -o``
write them for any model): a stand-in entry whose pages show those results, and none of what a registry
entry would say (parameters, licence, links), which the results do not hold."""
from __future__ import annotations

import re

from linnet.registry.schema import Entry, HfCheckpoint, Links
from linnet.results import Results

DESCRIPTION = "Not in Linnet's registry: these pages show its results files alone."


def unlisted_entry(model: str, results: Results, taken: set[str]) -> Entry:
    """The stand-in entry of ``model`` (a results file's model id, any text); its id names its pages, so it is
    made of safe characters and kept apart from ``taken`` (the ids in use, which it joins)."""
    base = "unlisted-" + (re.sub(r"[^a-z0-9.-]+", "-", model.lower()).strip("-.") or "model")
    page, n = base, 1
    while page in taken:
        n += 1
        page = f"{base}-{n}"
    taken.add(page)
    return Entry(id=page, name=model, description=DESCRIPTION, parameters=0, architecture="", licence="", tags=[],
                 links=Links(hugging_face=""), hf=HfCheckpoint(repo="", revision=""), bench=results.protocol)
