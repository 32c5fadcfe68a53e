"""Choosing the next token: greedy, or temperature with top-k and top-p, reproducible from a seed.

``Sampling`` is a request's parameters; a runner draws with them where its model runs (``sample_host`` is
the NumPy definition, used by backends whose logits live on the host).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from linnet.errors import LinnetError

# The seeds every backend's generator takes: NumPy's any size, torch's 64 bits, JAX's a signed 64-bit integer.
SEED_MAX = 2**63 - 1


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise LinnetError(f"temperature must be between 0 and 100, got {self.temperature}")
        if self.top_k < 0:
            raise LinnetError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise LinnetError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise LinnetError(f"seed must be in 0..2^63 - 1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sample_host(logits: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """One token id from a row of logits, on the host (NumPy): the definition backends sample by."""
    if sampling.greedy:
        return int(np.argmax(logits))
    probs = probabilities(logits, sampling)
    return int(rng.choice(probs.size, p=probs))


def probabilities(logits: np.ndarray, sampling: Sampling) -> np.ndarray:
    """The distribution a non-greedy ``sampling`` draws from, as float64 over the vocabulary."""
    scores = logits.astype(np.float64)
    scores = (scores - scores.max()) / sampling.temperature  # shifted first: a tiny temperature must not overflow
    if sampling.top_k and sampling.top_k < scores.size:
        cutoff = np.partition(scores, -sampling.top_k)[-sampling.top_k]
        scores = np.where(scores >= cutoff, scores, -np.inf)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if sampling.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]  # mass of the tokens ranked above each one
        probs[order[before >= sampling.top_p]] = 0.0
        probs /= probs.sum()
    return probs
