"""Prompt lookup: the row's own earlier tokens as the draft, free to propose."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from linnet.errors import LinnetError
from linnet.sampling import Sampling
from linnet.speculative.proposal import Proposal

NGRAM = 3  # the longest n-gram looked up, by default


class PromptLookup:
    """The longest of the row's last ``n``..1 tokens that occurred earlier in its prompt or output proposes
    the tokens that followed its latest occurrence. The proposal is certain (q one-hot), so under
    sampling a draft is kept with the target's probability of it."""

    name = "ngram"

    def __init__(self, n: int = NGRAM):
        if n < 1:
            raise LinnetError(f"the prompt lookup's n-gram needs at least 1 token, got {n}")
        self.n = n

    def propose(self, context: Sequence[int], k: int, sampling: Sampling, rng: np.random.Generator) -> Proposal:
        tokens = np.asarray(context, dtype=np.int64)
        for size in range(min(self.n, len(tokens) - 1), 0, -1):
            # windows starting before the tail's own start, so each has a token after it
            windows = sliding_window_view(tokens[:-1], size)
            found = np.flatnonzero((windows == tokens[-size:]).all(axis=1))
            if found.size:
                after = int(found[-1]) + size  # the latest occurrence: the most recent text is likeliest copied
                return Proposal(tokens[after:after + k].tolist())
        return Proposal()
