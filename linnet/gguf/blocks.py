"""A GGUF file's weights with its Q8_0, Q4_0, Q4_1, Q4_K and Q6_K tensors also as the file stores them.

``blocks`` maps canonical names to (form, block bytes): rows of the file's own bytes (packed tensors cut
into their parts, interleaved-rope q and k rows put back in HF's order), for backends that compute on
them (``linnet.quantize``). The float32 arrays are dequantised (and cached) only when one of the
quantised tensors is first read as floats, so a backend that runs the blocks never widens the file.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType as Q

from linnet.gguf import dequantise, rope
from linnet.gguf.format import GGUFFile
from linnet.quantize import FORM_OF_TYPE
from linnet.spec import ModelSpec
from linnet.weight_cache import code_identity
from linnet.weights import Weights

if TYPE_CHECKING:
    from linnet.gguf.reader import PlanEntry

UNQUANTISED = (Q.F32, Q.F16, Q.BF16)


class GGUFWeights(Weights):
    def __init__(self, spec: ModelSpec, gguf: GGUFFile, plan: dict[str, PlanEntry],
                 dequantise_all: Callable[[], dict[str, np.ndarray]], load_time: float, source: str):
        """``plan``: the file's tensor names -> their canonical parts (shapes checked by the reader);
        ``dequantise_all``: every tensor as float32 (cached)."""
        self.spec, self.load_time = spec, load_time
        self.source = f"{source}\nblocks by {code_identity(sys.modules[__name__])}"
        self._gguf, self._plan = gguf, plan
        self._canonical = {canonical: name for name, (parts, _) in plan.items() for canonical in parts}
        self._dequantise_all = dequantise_all
        self._floats: dict[str, np.ndarray] | None = None

    @cached_property
    def blocks(self) -> dict[str, tuple[str, np.ndarray]]:
        tensors, out = self._gguf.tensors, {}
        for name, (parts, pack) in self._plan.items():
            if tensors[name].type in FORM_OF_TYPE:  # rows of whole blocks: packs cut between rows
                raw = self._gguf.raw(name)
                for canonical, rows in zip(parts, (raw,) if pack is None else pack.unpack(self.spec, raw)):
                    out[canonical] = (FORM_OF_TYPE[tensors[name].type],
                                      rope.rope_permute(self.spec, canonical, rows, inverse=True))
        return out

    @property  # the base class's dict, dequantised on first use
    def _arrays(self) -> dict[str, np.ndarray]:  # type: ignore[override]
        if self._floats is None:
            self._floats = self._dequantise_all()
        return self._floats

    def __getitem__(self, name: str) -> np.ndarray:
        stored = self._canonical[name]
        if self._floats is None and self._gguf.tensors[stored].type in UNQUANTISED:  # no widening needed
            return dequantise.dequantised(self._gguf, self.spec, {stored: self._plan[stored]})[name]
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._canonical)

    def __len__(self) -> int:
        return len(self._canonical)
