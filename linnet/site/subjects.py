"""One id and one name per subject, in every run: a row is renamed from what it is (backend, mode, weight form).

Results files written at different times named one subject differently ("Linnet, inductor" and "Linnet,
inductor f32"; ``jax:generated`` and ``xla:jax``), which split it over several rows. Pages read every
file through ``canonical``, which rebuilds each row's id and name the same way:

- a Linnet backend: the backend registry's id and display (``torch:inductor``, "Linnet, inductor"), the
  GPU providers named as the seed pages name them ("Linnet, ONNX Runtime", "Linnet, TensorRT");
- linnet.serve on a backend: ``serve:torch:inductor``, "linnet.serve, inductor"; on a package only
  (``serve:jax``, as published): ``serve:xla``, "linnet.serve, XLA";
- Triton hosting linnet.serve: ``triton:linnet[:BACKEND]``, "Triton, linnet.serve backend[, BACKEND]";
- a peer (transformers, vLLM, llama.cpp, ...): its id and the name it was recorded with;

then the weight form where the row records it, in its id (``@f32``) or its notes ("weights 988 MB in
bf16", "weights q8_0, f32"): ``torch:inductor@bf16``, "Linnet, inductor bf16". A row that does not record
its form keeps a bare id and name, as the published rows do ("Linnet, inductor").
"""
from __future__ import annotations

import dataclasses
import re
from functools import cache

from linnet.backends.registry import backends
from linnet.errors import ResultsError
from linnet.results import Results, Row, validate

# Ids that earlier files gave a backend or a package, and the backend registry's own.
ALIASES = {"jax": "xla", "jax:generated": "xla:jax", "jax:stablehlo": "xla:stablehlo"}
# The seed pages name the GPU providers by product; the backend registry names them by provider.
SEED_NAMES = {"onnx:cuda": "Linnet, ONNX Runtime", "onnx:tensorrt": "Linnet, TensorRT"}
# A backend package as a serving row names it when it does not say which mode ran ("linnet.serve, XLA").
PACKAGES = {"torch": "PyTorch", "xla": "XLA", "onnx": "ONNX Runtime"}
# "f32" alone, "weights bf16, f32 (...)", or "reads ... (weights 988.07 MB in q8_0, f32, KV cache ...)":
# the first form named is the weights' own (the f32 after it is the norms').
FORM = re.compile(r"^(f32|f16|bf16)$|(?:^|\()weights (?:[\d.]+ MB in )?([a-z]+\d+(?:_[a-z0-9]+)?)\b", re.IGNORECASE)
LINNET = "Linnet, "


@cache
def _displays() -> dict[str, str]:
    return {b.id: SEED_NAMES.get(b.id, b.display) for b in backends()}


def _backend(ref: str) -> tuple[str, str] | None:
    """A backend id or package name as a row id holds it -> its canonical id and its name without "Linnet, "."""
    ref = ALIASES.get(ref, ref)
    if ref in _displays():
        return ref, _displays()[ref].removeprefix(LINNET)
    return (ref, PACKAGES[ref]) if ref in PACKAGES else None


def weight_form(row: Row) -> str | None:
    """The form its weights ran in, from its id (``onnx:cpu@f16``) or else its notes; None where unrecorded."""
    form = row.id.partition("@")[2]
    if form:
        return form
    for note in row.notes:
        m = FORM.search(note)
        if m:
            return (m.group(1) or m.group(2)).lower()
    return None


def identify(row: Row) -> tuple[str, str]:
    """The row's canonical id and name."""
    base = row.id.partition("@")[0]
    form = weight_form(row)
    backend = _backend(base) if row.linnet else None
    serve = _backend(base.removeprefix("serve:")) if row.linnet and base.startswith("serve:") else None
    hosted = base.removeprefix("triton:linnet").removeprefix(":")
    if backend:
        row_id, name = backend[0], LINNET + backend[1]
    elif serve:
        row_id, name = f"serve:{serve[0]}", f"linnet.serve, {serve[1]}"
    elif row.linnet and base.startswith("triton:linnet") and (not hosted or _backend(hosted)):
        inner = _backend(hosted) if hosted else None
        row_id = "triton:linnet" + (f":{inner[0]}" if inner else "")
        name = "Triton, linnet.serve backend" + (f", {inner[1]}" if inner else "")
    else:  # a peer, or a backend this Linnet does not know: as recorded
        row_id, name = base, row.name.removesuffix(f" {form}") if form else row.name
        # Ray Serve's rows name their replica count, which their notes give: one name for the subject
        name = re.sub(r" \(\d+ replicas?(, )?", " (", name).replace(" ()", "")
    return (f"{row_id}@{form}", f"{name} {form}") if form else (row_id, name)


def canonical(results: Results, where: str = "results") -> Results:
    """``results`` with every row under its canonical id and name, comparisons following; two rows of one
    file that turn out to be one subject are an error naming both."""
    ids: dict[str, str] = {}
    named: dict[str, tuple[str, str]] = {}
    for row in results.rows:
        new_id, name = identify(row)
        if new_id in named:
            raise ResultsError(f"{where}: rows {named[new_id][0]!r} and {row.id!r} are one subject ({new_id})")
        ids[row.id] = new_id
        named[new_id] = (row.id, name)

    def renamed(row: Row) -> Row:
        a = row.against
        against = None if a is None else dataclasses.replace(a, row=ids.get(a.row, a.row))
        return dataclasses.replace(row, id=ids[row.id], name=named[ids[row.id]][1], against=against)

    mapped = dataclasses.replace(results, rows=[renamed(r) for r in results.rows])
    validate(mapped, where)
    return mapped

