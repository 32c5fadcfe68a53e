"""GGUF tensors as float32 arrays in Hugging Face's layout.

``gguf.quants`` dequantises; llama's q and k rows are put back in HF's order. The source text of this
module and of those it calls keys the converted-weights cache (``code()``), so a change here, or a new
``gguf`` release, never reuses a file dequantised by the old code.
"""
from __future__ import annotations

import sys

import gguf.quants
import numpy as np

from linnet.gguf import rope
from linnet.gguf.format import GGUFFile
from linnet.spec import ModelSpec
from linnet.weight_cache import code_identity


def dequantised(gguf_file: GGUFFile, spec: ModelSpec, names: dict[str, str]) -> dict[str, np.ndarray]:
    """``names`` maps the file's tensor names to canonical ones; returns canonical name -> float32 array."""
    out = {}
    for name, canonical in names.items():
        array = gguf.quants.dequantize(gguf_file.raw(name), gguf_file.tensors[name].type).astype(np.float32, copy=False)
        out[canonical] = rope.rope_permute(spec, canonical, array, inverse=True)
    return out


def code() -> str:
    """The identity of the code that dequantises: a digest of this module, ``gguf.rope`` and ``gguf.quants``."""
    return code_identity(sys.modules[__name__], rope, gguf.quants)
