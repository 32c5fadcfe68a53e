"""Canonical tensor names, and each checkpoint format's names for them, from the architecture's table.

Per layer ``i``: ``layers.{i}.<part>``. Global: ``embed``, ``norm``, ``lm_head`` (absent when the head is
tied to ``embed``), and their biases where a family has them. Matrices keep the HF ``[out, in]`` layout.
Which tensors a model has, and their shapes, is what its Program reads (``Program.expected_shapes``).
"""
from __future__ import annotations

from linnet.errors import UnsupportedModel
from linnet.spec import ModelSpec


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor the spec needs, with its shape; nothing optional is left in."""
    from linnet.program import build_program

    return build_program(spec).expected_shapes()


def format_name(spec: ModelSpec, canonical: str, fmt: int) -> str | None:
    """``fmt`` 0 = Hugging Face, 1 = GGUF; None where the format packs the tensor with others."""
    from linnet.arch import get_architecture

    table = get_architecture(spec.architecture).names
    part, i = canonical, ""
    if canonical.startswith("layers."):
        _, i, part = canonical.split(".", 2)
    if part not in table:
        raise UnsupportedModel(f"{spec.architecture} has no name for tensor {canonical!r}")
    name = table[part][fmt]
    return None if name is None else name.format(i=i)


def hf_name(spec: ModelSpec, canonical: str) -> str | None:
    return format_name(spec, canonical, 0)


def hf_alternative(spec: ModelSpec, canonical: str) -> list[str]:
    """The HF names of ``canonical`` in the architecture's other layout (``Architecture.hf_alternatives``):
    one, or one per expert to stack; none where it has no other."""
    from linnet.arch import get_architecture

    i, _, part = canonical.removeprefix("layers.").partition(".") if canonical.startswith("layers.") \
        else ("", "", canonical)
    template = get_architecture(spec.architecture).hf_alternatives.get(part)
    if template is None:
        return []
    experts = range(spec.moe.experts) if "{e}" in template and spec.moe is not None else [0]
    return [template.format(i=i, e=e) for e in experts]


def gguf_name(spec: ModelSpec, canonical: str) -> str | None:
    return format_name(spec, canonical, 1)
