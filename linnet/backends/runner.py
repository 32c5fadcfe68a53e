"""The Runner contract: the seam that generation, serving and benchmarks stand on.

A runner owns weights and a KV cache of ``rows x positions``. ``prefill`` fills one row from a start
position; ``decode`` advances every row by one token in a single fixed-shape call. Position ``p`` of a
row is always written before any query reads it, so stale or garbage entries past a row's length are
harmless and ``reset`` needs no clearing, only bookkeeping.
"""
from __future__ import annotations

import resource
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from linnet.errors import CacheFull, LinnetError
from linnet.spec import ModelSpec


def cache_positions(tokens: int, multiple: int = 128) -> int:
    """A KV-cache length that holds ``tokens``, rounded up to ``multiple``."""
    return -(-tokens // multiple) * multiple


@dataclass(frozen=True)
class CacheShape:
    rows: int = 1
    positions: int = 768


class Runner(ABC):
    """Backends implement ``_prefill`` and ``_decode``; this class checks every call's bounds."""

    name: str = "runner"

    def __init__(self, spec: ModelSpec, cache: CacheShape):
        if cache.rows < 1 or cache.positions < 2:
            raise LinnetError(f"cache must have at least 1 row and 2 positions, got {cache}")
        self.spec = spec
        self.cache = cache
        self.lengths = [0] * cache.rows  # tokens held by each row
        self.load_time = 0.0

    # -- the contract -------------------------------------------------------------------------
    def prefill(self, row: int, tokens: Sequence[int], start: int = 0, all_logits: bool = False) -> np.ndarray:
        """Write ``tokens`` at ``start..`` of ``row``; logits of the last position (or of every one)."""
        self._check_row(row)
        if not tokens:
            raise LinnetError("prefill needs at least one token")
        if start > self.lengths[row]:
            raise LinnetError(f"prefill at position {start} leaves a gap: row {row} holds {self.lengths[row]}")
        self._check_fits(start + len(tokens))
        self._check_tokens(tokens)
        logits = self._prefill(row, list(tokens), start, all_logits)
        self.lengths[row] = start + len(tokens)
        return logits

    def decode(self, tokens: Sequence[int], active: Sequence[bool] | None = None) -> np.ndarray:
        """One token for every row (inactive rows' tokens are ignored); logits ``[rows, vocab]``."""
        if len(tokens) != self.cache.rows:
            raise LinnetError(f"decode takes one token per cache row ({self.cache.rows}), got {len(tokens)}")
        active = [True] * self.cache.rows if active is None else list(active)
        positions = []
        for row, on in enumerate(active):
            if on:
                self._check_fits(self.lengths[row] + 1)
            # An inactive row writes garbage at its next free position, which is written again before it is read.
            positions.append(min(self.lengths[row], self.cache.positions - 1))
        self._check_tokens([t for t, on in zip(tokens, active) if on])
        tokens = [t if on else 0 for t, on in zip(tokens, active)]
        logits = self._decode(tokens, positions)
        for row, on in enumerate(active):
            if on:
                self.lengths[row] += 1
        return logits

    def reset(self, row: int) -> None:
        self._check_row(row)
        self.lengths[row] = 0

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "rows": self.cache.rows, "positions": self.cache.positions}

    def peak_memory(self) -> int:
        """Peak resident memory of this process in bytes (backends on a GPU report the device's)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    # -- backends ------------------------------------------------------------------------------
    @abstractmethod
    def _prefill(self, row: int, tokens: list[int], start: int, all_logits: bool) -> np.ndarray: ...

    @abstractmethod
    def _decode(self, tokens: list[int], positions: list[int]) -> np.ndarray: ...

    # -- checks --------------------------------------------------------------------------------
    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.cache.rows:
            raise LinnetError(f"row {row} is outside the cache's {self.cache.rows} rows")

    def _check_fits(self, length: int) -> None:
        if length > self.cache.positions:
            raise CacheFull(
                f"{length} tokens do not fit in the KV cache of {self.cache.positions} positions; "
                "use a shorter prompt, fewer new tokens, or a larger --cache-positions"
            )

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise LinnetError(f"token ids {bad[:5]} are outside the vocabulary of {self.spec.vocab_size}")
