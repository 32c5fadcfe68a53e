"""A GGUF file's weights with its Q8_0, Q4_0, Q4_1, Q4_K and Q6_K tensors also as the file stores them.

``blocks`` maps canonical names to (form, block bytes): rows of the file's own bytes (llama's q and k
rows put back in HF's order), for backends that compute on them (``linnet.quantize``). The float32
arrays are dequantised (and cached) only when one of the quantised tensors is first read as floats, so
a backend that runs the blocks never widens the file.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from functools import cached_property

import numpy as np
from gguf import GGMLQuantizationType as Q

from linnet.gguf import dequantise, rope
from linnet.gguf.format import GGUFFile
from linnet.quantize import FORM_OF_TYPE
from linnet.spec import ModelSpec
from linnet.weight_cache import code_identity
from linnet.weights import Weights

UNQUANTISED = (Q.F32, Q.F16, Q.BF16)


class GGUFWeights(Weights):
    def __init__(self, spec: ModelSpec, gguf: GGUFFile, names: dict[str, str],
                 dequantise_all: Callable[[], dict[str, np.ndarray]], load_time: float, source: str):
        """``names``: the file's tensor names -> canonical ones (shapes checked by the reader);
        ``dequantise_all``: every tensor as float32 (cached)."""
        self.spec, self.load_time = spec, load_time
        self.source = f"{source}\nblocks by {code_identity(sys.modules[__name__])}"
        self._gguf, self._names = gguf, names
        self._canonical = {canonical: name for name, canonical in names.items()}
        self._dequantise_all = dequantise_all
        self._floats: dict[str, np.ndarray] | None = None

    @cached_property
    def blocks(self) -> dict[str, tuple[str, np.ndarray]]:
        tensors = self._gguf.tensors
        return {canonical: (FORM_OF_TYPE[tensors[name].type],
                            rope.rope_permute(self.spec, canonical, self._gguf.raw(name), inverse=True))
                for name, canonical in self._names.items() if tensors[name].type in FORM_OF_TYPE}

    @property
    def _arrays(self) -> dict[str, np.ndarray]:
        if self._floats is None:
            self._floats = self._dequantise_all()
        return self._floats

    def __getitem__(self, name: str) -> np.ndarray:
        stored = self._canonical[name]
        if self._floats is None and self._gguf.tensors[stored].type in UNQUANTISED:  # no widening needed
            return dequantise.dequantised(self._gguf, self.spec, {stored: name})[name]
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._canonical)

    def __len__(self) -> int:
        return len(self._canonical)
