"""The dtypes Linnet stores and runs weights in, with each one's name in config.json, safetensors and NumPy."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np


@dataclass(frozen=True)
class DType:
    name: str  # Linnet's, as on the command line: "bf16"
    hf: str  # config.json's dtype / torch_dtype, and NumPy's name: "bfloat16"
    safetensors: str  # a safetensors header's: "BF16"

    @property
    def numpy(self) -> np.dtype:
        return _numpy_dtype(self.hf)


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("f32", "float32", "F32"),
    DType("f16", "float16", "F16"),
    DType("bf16", "bfloat16", "BF16"),
)}
BY_HF = {d.hf: d for d in DTYPES.values()}
BY_SAFETENSORS = {d.safetensors: d for d in DTYPES.values()}


@cache
def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":  # NumPy has none; ml_dtypes' is imported only when needed: 0.4 s in ml_dtypes 0.7
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
