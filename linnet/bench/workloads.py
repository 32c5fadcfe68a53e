"""Chat prompts of the kinds where speculative decoding pays (the answer copies the prompt) and of one
where it does not (free-form chat), for ``linnet bench --speculate``."""
from __future__ import annotations

from linnet.tokenizer import Tokenizer

PASSAGE = ("The harbour town of Elmsford was founded in 1742 by fishermen from the northern coast. Its "
           "lighthouse, built of grey granite, stands 38 metres tall and was automated in 1981. Every August "
           "the town holds a regatta that draws sailors from across the region, and the old customs house "
           "on Quay Street now holds a museum of maritime history.")

CODE = '''def mean(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)


def spread(values):
    low = min(values)
    high = max(values)
    return high - low
'''

WORKLOADS: dict[str, list[str]] = {
    "rewrite": [
        "Correct the spelling mistakes in this passage and write it out in full: \"The quick brwn fox jumpd "
        "over the lazy dog. It was a suny day in the vilage, and all the childern were playing in the park "
        "near the old church. The baker sold fresh bred to everyone who pased by.\"",
        f"Rewrite this passage, changing only 'town' to 'city' everywhere:\n\n{PASSAGE}",
    ],
    "code": [
        f"Rename the function `mean` to `average` in this code and show the whole file:\n\n```python\n{CODE}```",
        f"Add a docstring to each function in this code and show the whole file:\n\n```python\n{CODE}```",
    ],
    "document": [
        f"Read this document:\n\n{PASSAGE}\n\nQuote the sentence that says how tall the lighthouse is.",
        f"Read this document:\n\n{PASSAGE}\n\nWhat does the old customs house hold? Answer with the words "
        "of the document.",
    ],
    "extract": [
        "From this record, list the fields name, email and city as 'field: value' lines:\n\nName: Maria "
        "Okafor\nEmail: maria.okafor@example.org\nPhone: +44 20 7946 0958\nCity: Leeds\nJoined: 2021-03-14",
        f"From this passage, list every year and what happened in it, one per line:\n\n{PASSAGE}",
    ],
    "chat": [
        "Write a short poem about the sea at night.",
        "What are three good ways to stay focused while studying?",
    ],
}
COPYING = ("rewrite", "code", "document", "extract")


def workload_prompts(name: str) -> list[tuple[str, str]]:
    """(kind, prompt) pairs: one kind, 'copying' (every kind whose answer copies), or 'all'."""
    kinds = {"all": list(WORKLOADS), "copying": list(COPYING)}.get(name, [name])
    return [(kind, prompt) for kind in kinds for prompt in WORKLOADS[kind]]


WORKLOAD_NAMES = ("all", "copying", *WORKLOADS)


def chat_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """A workload prompt as the user's message, through the model's chat template."""
    return tokenizer.encode_chat([{"role": "user", "content": prompt}])
