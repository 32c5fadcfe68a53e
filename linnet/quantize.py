"""Block-quantised weights: llama.cpp's blocks, kept as the bytes GGUF stores.

A matrix [out, in] is cut into blocks along ``in``. Q8_0, Q4_0, Q4_1: blocks of 32, each an f16 scale
``d`` (Q4_1: then an f16 min ``m``) and its 32 codes: Q8_0 int8 ``q``, w = d * q; Q4_0 and Q4_1 one byte
per two codes (element j in the low nibble, j + 16 in the high), w = d * (q - 8) and w = d * q + m.
The K-quants come in super-blocks of 256: Q4_K eight sub-blocks of 32 with 6-bit scales and mins under
f16 ``d`` and ``dmin`` (w = d * sc * q - dmin * m), Q6_K sixteen of 16 with int8 scales (w = d * sc *
(q - 32), 6-bit q). A quantised weight is its rows of block bytes, uint8 [out, in / elements *
BLOCK_BYTES[form]], exactly as a GGUF file holds it, so a file's own tensors are used as they are and
``gguf.quants`` dequantises them (and quantises the forms Linnet makes, ``MADE``).

Every form is an affine code per block (``affine``): w = scale * (code - zero) + min, which is what
ONNX Runtime's n-bit operators take.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from linnet.errors import LinnetError

BLOCK = 32  # the blocks of the forms Linnet makes
FORMS = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
         "q4_k": GGMLQuantizationType.Q4_K, "q6_k": GGMLQuantizationType.Q6_K}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k": 144, "q6_k": 210}
ELEMENTS = {"q8_0": 32, "q4_0": 32, "q4_1": 32, "q4_k": 256, "q6_k": 256}  # per block of bytes
MADE = ("q8_0", "q4_0", "q4_1")  # the forms --quantize makes (gguf.quants quantises only these)
K_QUANTS = ("q4_k", "q6_k")  # the K-quant forms Linnet reads from a GGUF file
FORM_OF_TYPE = {t: form for form, t in FORMS.items()}


def check_form(form: str, what: str = "weights", forms: tuple[str, ...] = MADE) -> str:
    """``form`` if it is one of ``forms``, else an error that names it."""
    if form not in forms:
        raise LinnetError(f"{what} cannot be quantised as {form!r}: the block forms run here are "
                          f"{', '.join(forms)} (or gguf: a GGUF file's own, or none)")
    return form


def quantized(array: np.ndarray, form: str) -> np.ndarray:
    """A float matrix [out, in] (in a multiple of 32), or a stack of them [n, out, in], as rows of
    ``form``'s block bytes."""
    check_form(form)
    if array.ndim not in (2, 3) or array.shape[-1] % BLOCK:
        raise LinnetError(f"only matrices whose rows are whole blocks of {BLOCK} can be quantised, "
                          f"got shape {list(array.shape)}")
    return quantize(np.ascontiguousarray(array, dtype=np.float32), FORMS[form])


def dequantized(blocks: np.ndarray, form: str) -> np.ndarray:
    """Rows of ``form``'s block bytes as the float32 matrix they stand for."""
    return dequantize(blocks, FORMS[form]).astype(np.float32, copy=False)


@dataclass
class Affine:
    """A matrix [n, k] in blocks as w = scales * (codes - zero) + mins, per block of ``block`` elements."""
    codes: np.ndarray  # [n, k] uint8, in element order
    scales: np.ndarray  # [n, k / block] float32
    zero: int
    mins: np.ndarray | None  # [n, k / block] float32, or None for none
    block: int
    bits: int  # the codes' width: 4 or 8


def affine(blocks: np.ndarray, form: str) -> Affine:
    """Rows of ``form``'s block bytes as affine codes per block (values exactly those of ``dequantized``)."""
    n = blocks.shape[0]
    raw = blocks.reshape(n, -1, BLOCK_BYTES[form])

    def f16(at: int) -> np.ndarray:  # the f16 field at byte ``at`` of every block, as float32
        return np.ascontiguousarray(raw[:, :, at:at + 2]).view(np.float16)[..., 0].astype(np.float32)

    if form == "q8_0":
        return Affine((raw[:, :, 2:] ^ np.uint8(0x80)).reshape(n, -1), f16(0), 128, None, 32, 8)
    if form in ("q4_0", "q4_1"):
        packed = raw[:, :, 4 if form == "q4_1" else 2:]  # byte j: element j (low nibble), j + 16 (high)
        codes = np.concatenate([packed & 15, packed >> 4], axis=2).reshape(n, -1)
        return Affine(codes, f16(0), 8 if form == "q4_0" else 0, f16(2) if form == "q4_1" else None, 32, 4)
    if form == "q4_k":
        d, dmin, packed, qs = f16(0)[..., None], f16(2)[..., None], raw[:, :, 4:16], raw[:, :, 16:]
        low, high = packed[:, :, :4], packed[:, :, 4:8]
        sc = np.concatenate([low & 63, (packed[:, :, 8:] & 15) | ((low >> 6) << 4)], axis=2)
        m = np.concatenate([high & 63, (packed[:, :, 8:] >> 4) | ((high >> 6) << 4)], axis=2)
        chunks = qs.reshape(n, -1, 4, 32)  # 64 elements per 32 bytes: low nibbles, then high nibbles
        codes = np.stack([chunks & 15, chunks >> 4], axis=3).reshape(n, -1)
        return Affine(codes, (d * sc).reshape(n, -1), 0, (-dmin * m).reshape(n, -1), 32, 4)
    if form == "q6_k":
        ql, qh = raw[:, :, :128].reshape(n, -1, 2, 64), raw[:, :, 128:192].reshape(n, -1, 2, 32)
        sc = raw[:, :, 192:208].view(np.int8).astype(np.float32)
        low = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
        high = np.stack([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], axis=3)
        codes = (low | (high << 4)).reshape(n, -1)  # per half of 128: four quarters of 32
        return Affine(codes, (f16(208)[..., None] * sc).reshape(n, -1), 32, None, 16, 8)
    raise LinnetError(f"no affine form for {form!r}")


def int8_rounded(x: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """x [..., k] (k a multiple of ``block``) rounded to int8 per block along its last axis, scale
    max|x| / 127 and to nearest, back as float32: what a product with int8 activations multiplies."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    safe = np.where(scale > 0, scale, np.float32(1))
    return (np.round(blocks / safe) * scale).reshape(x.shape).astype(np.float32)


# The converted-weights cache stores float types only: block bytes (an even count per block) travel as f16.
def to_storage(blocks: np.ndarray) -> np.ndarray:
    return blocks.view(np.float16)


def from_storage(array: np.ndarray) -> np.ndarray:
    return array.view(np.uint8)


def block_names(quantized: tuple[tuple[str, str, str], ...], num_layers: int) -> dict[str, str]:
    """Each weight stored in blocks, by its full name (``layers.3.qkv``), and its form, from a program's
    or weight plan's ``quantized`` (section, weight, form) entries."""
    layers = [f"layers.{i}." for i in range(num_layers)]
    return {prefix + name: form for section, name, form in quantized
            for prefix in (layers if section == "layer" else [""])}
