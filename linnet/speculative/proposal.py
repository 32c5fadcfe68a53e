"""What a drafter hands the verifier: its tokens, and the distribution each was drawn from."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from linnet.sampling import Sampling


@dataclass(frozen=True)
class Proposal:
    tokens: list[int] = field(default_factory=list)
    # [len(tokens), vocab]: the distribution each token was drawn from; None: each was certain (one-hot),
    # as for prompt lookup or a greedy draft
    q: np.ndarray | None = None


class Drafter(Protocol):
    name: str

    def propose(self, context: Sequence[int], k: int, sampling: Sampling, rng: np.random.Generator) -> Proposal:
        """Up to ``k`` tokens to follow ``context`` (the row's tokens, its last not yet in the target's cache)."""
        ...
