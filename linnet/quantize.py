"""Block-quantised weights: llama.cpp's Q8_0, Q4_0 and Q4_1, kept as the bytes GGUF stores.

A matrix [out, in] is cut into blocks of 32 along ``in``; each block is an f16 scale ``d`` (Q4_1: then
an f16 min ``m``) and its 32 codes: Q8_0 int8 ``q``, w = d * q; Q4_0 and Q4_1 one byte per two codes
(element j in the low nibble, j + 16 in the high), w = d * (q - 8) and w = d * q + m. A quantised weight
is its rows of block bytes, uint8 [out, in / 32 * BLOCK_BYTES[form]], exactly as a GGUF file holds it,
so a file's own tensors are used as they are and ``gguf.quants`` quantises and dequantises them.
"""
from __future__ import annotations

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


# The converted-weights cache stores float types only: block bytes (an even count per block) travel as f16.
def to_storage(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float16)


def from_storage(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint8)
