"""llama.cpp's blocks (``linnet.quantize``) as ONNX Runtime's n-bit operators take them.

com.microsoft MatMulNBits and GatherBlockQuantized read a matrix [N, K] as uint8 codes in blocks along
K and float scales [N, K / block]: w = (q - zero point) * scale, 4-bit codes two a byte with the even
element in the low nibble, and a zero point of 8 (4 bits) or 128 (8 bits) where none is given. Every
block form is such a code (``linnet.quantize.affine``), so each maps to them without changing a value:

- q8_0: the codes + 128, the default zero point; q6_k: 6-bit codes in bytes, zero points of 32 and
  blocks of 16;
- q4_0: the nibbles re-paired (GGUF puts element j and j + 16 in one byte), the default zero point;
- q4_1, q4_k (w = scale * q + min): zero points of 0 and the mins apart, added as ``min`` times each
  block's sum of x (ONNX Runtime's float zero points would express the min but fall off its fast
  kernels; 8-bit ones are refused).

Scales and mins are the blocks' values in the activations' type (f32 or f16).

com.microsoft QMoE reads the experts' stacks [E, N, K] in blocks too, as codes [E, N, K * bits / 8] and
scales [E, N, K / block], with the default zero point only: the symmetric forms, ``STACK_FORMS``.
"""
from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

from linnet.quantize import affine

PARTS = ("codes", "scales", "zero_points", "mins")  # the initializers a matrix in blocks becomes
BLOCK_SIZE = {"q6_k": 16}  # elements per scale where not 32
BITS = {"q8_0": 8, "q6_k": 8}  # code width where not 4
STACK_FORMS = ("q8_0", "q4_0")  # the forms QMoE runs an expert stack in


def block_size(form: str) -> int:
    return BLOCK_SIZE.get(form, 32)


def bits(form: str) -> int:
    return BITS.get(form, 4)


def onnx_parts(blocks: np.ndarray, form: str, float_type: DTypeLike = np.float32) -> dict[str, np.ndarray]:
    """Rows of ``form``'s block bytes as MatMulNBits' inputs: codes [N, K / block, block * bits / 8]
    uint8, scales [N, K / block] in ``float_type`` (the activations'), zero points where they are not
    the default (4 bits: packed two a byte), and mins [N, K / block] where the form has them."""
    a = affine(blocks, form)
    n, nb = a.scales.shape
    codes = a.codes.reshape(n, nb, a.block)
    if a.bits == 4:
        codes = codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)
    parts = {"codes": np.ascontiguousarray(codes, dtype=np.uint8), "scales": a.scales.astype(float_type)}
    if a.zero != 1 << (a.bits - 1):
        zero = np.uint8(a.zero | (a.zero << 4)) if a.bits == 4 else np.uint8(a.zero)
        parts["zero_points"] = np.full((n, -(-nb // 2) if a.bits == 4 else nb), zero, np.uint8)
    if a.mins is not None:
        parts["mins"] = a.mins.astype(float_type)
    return parts


def stack_parts(blocks: np.ndarray, form: str, float_type: DTypeLike = np.float32) -> dict[str, np.ndarray]:
    """An expert stack's block bytes [E, N, row bytes] as QMoE's inputs: codes [E, N, K * bits / 8] uint8
    and scales [E, N, K / block] in ``float_type``."""
    if form not in STACK_FORMS:
        raise ValueError(f"QMoE runs expert stacks in {', '.join(STACK_FORMS)}, not {form}")
    experts, n = blocks.shape[:2]
    parts = onnx_parts(blocks.reshape(experts * n, -1), form, float_type)
    return {part: value.reshape(experts, n, -1) for part, value in parts.items()}
