"""Block-quantised weights: llama.cpp's Q8_0, Q4_0 and Q4_1, kept as the bytes GGUF stores.

A matrix [out, in] is cut into blocks of 32 along ``in``; each block is an f16 scale ``d`` (Q4_1: then
an f16 min ``m``) and its 32 codes: Q8_0 int8 ``q``, w = d * q; Q4_0 and Q4_1 one byte per two codes
(element j in the low nibble, j + 16 in the high), w = d * (q - 8) and w = d * q + m. A quantised weight
is its rows of block bytes, uint8 [out, in / 32 * BLOCK_BYTES[form]], exactly as a GGUF file holds it,
so a file's own tensors are used as they are and ``gguf.quants`` quantises and dequantises them.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from linnet.errors import LinnetError

BLOCK = 32
FORMS = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
FORM_OF_TYPE = {t: form for form, t in FORMS.items()}


def check_form(form: str, what: str = "weights") -> str:
    if form not in FORMS:
        raise LinnetError(f"{what} cannot be quantised as {form!r}: the block forms run here are "
                          f"{', '.join(FORMS)} (or gguf: a GGUF file's own, or none)")
    return form


def quantized(array: np.ndarray, form: str) -> np.ndarray:
    """A float matrix [out, in] (in a multiple of 32) as rows of ``form``'s block bytes."""
    if array.ndim != 2 or array.shape[1] % BLOCK:
        raise LinnetError(f"only matrices whose rows are whole blocks of {BLOCK} can be quantised, "
                          f"got shape {list(array.shape)}")
    return quantize(np.ascontiguousarray(array, dtype=np.float32), FORMS[form])


def dequantized(blocks: np.ndarray, form: str) -> np.ndarray:
    """Rows of ``form``'s block bytes as the float32 matrix they stand for."""
    return dequantize(blocks, FORMS[form]).astype(np.float32, copy=False)


def block_scales(blocks: np.ndarray, form: str) -> np.ndarray:
    """A matrix's scales d [out, in / 32], float16 as stored."""
    raw = blocks.reshape(blocks.shape[0], -1, BLOCK_BYTES[form])
    return np.ascontiguousarray(raw[:, :, 0:2]).view(np.float16)[..., 0]


def block_mins(blocks: np.ndarray) -> np.ndarray:
    """A q4_1 matrix's mins m [out, in / 32], float16 as stored."""
    raw = blocks.reshape(blocks.shape[0], -1, BLOCK_BYTES["q4_1"])
    return np.ascontiguousarray(raw[:, :, 2:4]).view(np.float16)[..., 0]


def int8_rounded(x: np.ndarray) -> np.ndarray:
    """x [..., k] (k a multiple of 32) rounded to int8 per block of 32 along its last axis, scale
    max|x| / 127 and to nearest, back as float32: what a product with int8 activations multiplies."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, BLOCK)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    safe = np.where(scale > 0, scale, np.float32(1))
    return (np.round(blocks / safe) * scale).reshape(x.shape).astype(np.float32)


# The converted-weights cache stores float types only: block bytes (an even count per block) travel as f16.
def to_storage(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float16)


def from_storage(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint8)


def block_forms(program: Any, weights: Any, quantize: str) -> dict[tuple[str, str], str]:
    """(section, matrix) -> block form of the matrices ``quantize`` puts in blocks: "none", none; a form
    (``FORMS``), every matrix; "gguf", each matrix that ``weights`` (a GGUF file's) stores in a block form.
    ``program`` is a ``linnet.program.Program``; the result goes to ``linnet.program.quantize_weights``."""
    from linnet.program import infer_types

    if quantize == "none":
        return {}
    types = infer_types(program)
    matrices = {("layer" if section == "layer" else "head", name[2:]) for section, env in types.items()
                for name, value in env.items() if name.startswith("w.") and len(value.shape) == 2}
    if program.spec.tie_word_embeddings:
        matrices.discard(("head", "lm_head"))  # it is the embedding
    if quantize != "gguf":
        return dict.fromkeys(sorted(matrices), check_form(quantize))
    stored = getattr(weights, "blocks", {})  # name -> (form, bytes)
    parts = dict(program.fused)
    forms = {}
    for section, name in sorted(matrices):
        prefixes = [f"layers.{i}." for i in range(program.spec.num_layers)] if section == "layer" else [""]
        found = {stored.get(prefix + part, ("",))[0] for prefix in prefixes for part in parts.get(name, (name,))}
        if len(found) == 1 and found <= set(FORMS):
            forms[section, name] = found.pop()
    return forms


def block_names(quantized: tuple[tuple[str, str, str], ...], num_layers: int) -> dict[str, str]:
    """Each weight stored in blocks, by its full name (``layers.3.qkv``), and its form, from a program's
    or weight plan's ``quantized`` (section, weight, form) entries."""
    layers = [f"layers.{i}." for i in range(num_layers)]
    return {prefix + name: form for section, name, form in quantized
            for prefix in (layers if section == "layer" else [""])}
