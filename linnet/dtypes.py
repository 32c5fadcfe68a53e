"""The dtypes Linnet stores and runs weights in, with each one's name in config.json, safetensors and NumPy."""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # Linnet's, as on the command line: "bf16"
    hf: str  # config.json's dtype / torch_dtype: "bfloat16"
    safetensors: str  # a safetensors header's: "BF16"
    numpy: np.dtype  # bf16 is ml_dtypes', which NumPy lacks


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("f32", "float32", "F32", np.dtype(np.float32)),
    DType("f16", "float16", "F16", np.dtype(np.float16)),
    DType("bf16", "bfloat16", "BF16", np.dtype(ml_dtypes.bfloat16)),
)}
BY_HF = {d.hf: d for d in DTYPES.values()}
BY_SAFETENSORS = {d.safetensors: d for d in DTYPES.values()}
