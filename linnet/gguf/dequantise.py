"""GGUF tensors as float32 arrays in Hugging Face's layout.

``gguf.quants`` dequantises; tensors llama.cpp keeps packed are cut into their canonical parts, and the
q and k rows of graphs that rotate interleaved pairs are put back in HF's order. The source text of this
module and of those it calls keys the converted-weights cache (``code()``), so a change here, or a new
``gguf`` release, never reuses a file dequantised by the old code.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING

import gguf.quants
import numpy as np

from linnet.gguf import rope
from linnet.gguf.format import GGUFFile
from linnet.spec import ModelSpec
from linnet.weight_cache import code_identity

if TYPE_CHECKING:
    from linnet.gguf.reader import PlanEntry


def dequantised(gguf_file: GGUFFile, spec: ModelSpec, plan: dict[str, PlanEntry]) -> dict[str, np.ndarray]:
    """``plan`` maps the file's tensor names to their canonical parts (``linnet.gguf.reader.tensor_plan``);
    returns canonical name -> float32 array."""
    out: dict[str, np.ndarray] = {}
    for name, (parts, pack) in plan.items():
        array = gguf.quants.dequantize(gguf_file.raw(name), gguf_file.tensors[name].type).astype(np.float32, copy=False)
        out.update(zip(parts, (array,) if pack is None else pack.unpack(spec, array)))
    return {canonical: rope.rope_permute(spec, canonical, array, inverse=True) for canonical, array in out.items()}


def code(*unpacking: ModuleType) -> str:
    """The identity of the code that dequantises: a digest of this module, ``gguf.rope``, ``gguf.quants``
    and the modules whose functions unpack packed tensors."""
    return code_identity(sys.modules[__name__], rope, gguf.quants, *unpacking)
