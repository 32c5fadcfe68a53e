"""A request's own work on its row's logits before each token is drawn, and the logprobs it reports.

The engine gives each running request a ``RowLogits``; each step it asks it for an ``adjust`` (None where
the request changes nothing, so that row keeps drawing where the model runs) that edits the row's f32
logits in place, in vLLM's order: the grammar's mask, ``logit_bias``, the ``min_tokens`` ban on stop ids,
then the penalties. The definitions are vLLM's (and OpenAI's for the first two):

- ``presence_penalty`` p and ``frequency_penalty`` f, over the tokens generated so far: a token generated
  c > 0 times has ``c * f + p`` taken from its logit.
- ``repetition_penalty`` r, over the prompt's and the generated tokens: a positive logit of such a token is
  divided by r, a negative one multiplied by r (r > 1 discourages repeats, r < 1 encourages them).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Constraint(Protocol):
    """A grammar a request's tokens must follow (structured output); one object per request, stateful."""

    def mask(self, logits: np.ndarray) -> None:
        """In place: the logits of tokens the grammar forbids now become -inf."""

    def accept(self, token: int) -> None:
        """Advance past ``token``, which has been drawn."""

    @property
    def finished(self) -> bool:
        """The grammar is complete: the request ends (finish_reason "stop")."""


@dataclass(frozen=True)
class TokenLogprob:
    """A drawn token's log-probability under the model and the most likely tokens at its place, best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0

    @property
    def active(self) -> bool:
        return self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0


class RowLogits:
    """One request's logits work, fed each drawn token (``accept``)."""

    def __init__(self, prompt_ids: Sequence[int], penalties: Penalties, logit_bias: Sequence[tuple[int, float]],
                 min_tokens: int, banned_early: Sequence[int], constraint: Constraint | None):
        self.penalties = penalties
        self.constraint = constraint
        self.min_tokens = min_tokens
        self.generated = 0
        self._bias_ids = np.array([t for t, _ in logit_bias], dtype=np.int64)
        self._bias = np.array([b for _, b in logit_bias], dtype=np.float32)
        self._banned = np.array(sorted(set(banned_early)), dtype=np.int64)
        self._counts: dict[int, int] = {}  # generated token -> times
        self._seen = set(prompt_ids) if penalties.repetition != 1.0 else set()
        self._seen_ids: np.ndarray | None = None  # ``_seen`` as an array, rebuilt when it grows

    def accept(self, token: int) -> None:
        self.generated += 1
        self._counts[token] = self._counts.get(token, 0) + 1
        if self.penalties.repetition != 1.0 and token not in self._seen:
            self._seen.add(token)
            self._seen_ids = None

    def adjust(self) -> Callable[[np.ndarray], None] | None:
        """This step's edit of the row's logits, or None where it would change nothing."""
        ban = self._banned.size > 0 and self.generated < self.min_tokens
        if not (self.constraint or self._bias_ids.size or ban or self.penalties.active):
            return None
        return lambda logits: self._apply(logits, ban)

    def _apply(self, logits: np.ndarray, ban: bool) -> None:
        if self.constraint is not None:
            self.constraint.mask(logits)
        if self._bias_ids.size:
            logits[self._bias_ids] += self._bias
        if ban:
            logits[self._banned] = -np.inf
        p = self.penalties
        if p.repetition != 1.0 and self._seen:
            if self._seen_ids is None:
                self._seen_ids = np.fromiter(self._seen, dtype=np.int64, count=len(self._seen))
            seen = logits[self._seen_ids]
            logits[self._seen_ids] = np.where(seen > 0, seen / p.repetition, seen * p.repetition)
        if (p.presence or p.frequency) and self._counts:
            ids = np.fromiter(self._counts, dtype=np.int64, count=len(self._counts))
            times = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
            logits[ids] -= times * p.frequency + p.presence
