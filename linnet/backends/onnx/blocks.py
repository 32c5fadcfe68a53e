"""llama.cpp's blocks (``linnet.quantize``) as ONNX Runtime's n-bit operators take them.

com.microsoft MatMulNBits and GatherBlockQuantized read a matrix [N, K] as uint8 codes, blocks of 32
along K, and float scales [N, K / 32]: w = (q - zero point) * scale, 4-bit codes two a byte with the
even element in the low nibble, and a zero point of 8 (4 bits) or 128 (8 bits) where none is given.
So each block form maps to them without changing a value:

- q8_0 (int8 q, w = d * q): the codes + 128 as uint8, the default zero point;
- q4_0 (w = d * (q - 8)): the nibbles re-paired (GGUF puts element j and j + 16 in one byte), the
  default zero point;
- q4_1 (w = d * q + m): zero points of 0 and the mins apart, added as ``m`` times each block's sum of
  x (ONNX Runtime's float zero points would express the min but fall off its fast kernels; 8-bit ones
  are refused).

Scales (and mins) are the file's f16 values, in the activations' type (f32 or f16), exactly.
"""
from __future__ import annotations

import numpy as np

from linnet.quantize import BLOCK_BYTES, block_mins, block_scales

BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4}
PARTS = ("codes", "scales", "zero_points", "mins")  # the initializers a matrix in blocks becomes


def onnx_parts(blocks: np.ndarray, form: str, float_type: np.dtype = np.float32) -> dict[str, np.ndarray]:
    """Rows of ``form``'s block bytes [N, K / 32 * bytes] as MatMulNBits' inputs: codes [N, K / 32, 32 *
    bits / 8] uint8, scales [N, K / 32] in ``float_type`` (the activations'), and for q4_1 zero points
    (packed, all 0) and mins [N, K / 32]."""
    n, nb = blocks.shape[0], blocks.shape[1] // BLOCK_BYTES[form]
    raw = blocks.reshape(n, nb, BLOCK_BYTES[form])
    scales = block_scales(blocks, form).astype(float_type)
    if form == "q8_0":
        return {"codes": raw[:, :, 2:] ^ np.uint8(0x80), "scales": scales}
    start = 4 if form == "q4_1" else 2
    packed = raw[:, :, start:]  # byte j: element j (low nibble), element j + 16 (high)
    codes = np.concatenate([packed & 15, packed >> 4], axis=2)  # [N, nb, 32] in element order
    parts = {"codes": (codes[:, :, 0::2] | (codes[:, :, 1::2] << 4)).astype(np.uint8), "scales": scales}
    if form == "q4_1":
        parts["zero_points"] = np.zeros((n, -(-nb // 2)), np.uint8)
        parts["mins"] = block_mins(blocks).astype(float_type)
    return parts
