"""Speculative decoding in the serving engine: the server-wide setting and which rows it applies to.

While few rows are busy a step is bound by reading the weights, not by arithmetic, so checking a row's
drafted tokens in the same pass costs next to nothing and each kept draft is a token for free. Past
``rows`` busy rows the batched decode step already shares each read of the weights among them, and the
engine decodes as without speculation. Drafts come from prompt lookup, or from a draft model on a runner
of its own with a cache row for each of the target's: target row r drafts on draft row r, which a new
request in the row reads its context into again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from linnet.backends.runner import Runner
from linnet.errors import LinnetError
from linnet.sampling import Sampling
from linnet.speculative import Drafter, DraftModel, PromptLookup, Speculator
from linnet.speculative.ngram import NGRAM
from linnet.speculative.speculator import DRAFT_TOKENS, check_draft_tokens

# Busy rows up to which rows speculate, by default. Past two, the batched decode step already shares each
# read of the weights among the rows, and a check's extra positions cost more arithmetic than their kept
# drafts save: four copying requests at a time, speculating up to 4 busy rows, ran at 0.95x of no
# speculation, up to 2 at 1.02x (docs/SPECULATIVE.md).
DEFAULT_ROWS = 2


@dataclass(frozen=True)
class Speculation:
    """At most ``draft_tokens`` drafts a row a step, used while at most ``rows`` rows are busy, drafted by
    prompt lookup of n-grams up to ``ngram`` tokens, or by the draft model of ``draft``, a runner with the
    target's rows and positions (its tokenizer checked to be the target's by whoever opened it:
    ``linnet.speculative.check_same_tokenizer``)."""

    draft_tokens: int = DRAFT_TOKENS
    ngram: int = NGRAM
    rows: int = DEFAULT_ROWS
    draft: Runner | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.draft_tokens < 1 or self.ngram < 1 or self.rows < 1:
            raise LinnetError(f"speculation needs at least one draft token, n-gram token and row, got "
                              f"{self.draft_tokens}, {self.ngram} and {self.rows}")

    def check(self, runner: Runner) -> None:
        check_draft_tokens(self.draft_tokens, runner)
        draft, cache = self.draft, runner.cache
        if draft is not None and (draft.cache.rows < cache.rows or draft.cache.positions < cache.positions):
            raise LinnetError(f"the draft model's runner has {draft.cache.rows} rows of {draft.cache.positions} "
                              f"positions; it needs the target's {cache.rows} of {cache.positions}")

    def drafts_each(self, rows: int) -> int:
        """The most drafts each of ``rows`` speculating rows proposes in a step. The step checks at most
        ``draft_tokens + 1`` positions in all, one row's whole check (or, past half that many rows, one
        draft a row), so that it stays about one pass over the weights: four rows each checking 9
        positions in one call ran at 0.66x of their batched decode (docs/SPECULATIVE.md)."""
        return max(1, (self.draft_tokens + 1) // rows - 1)

    def speculator(self, runner: Runner, row: int, sampling: Sampling) -> Speculator:
        """A new request's speculator in ``row``."""
        drafter: Drafter = PromptLookup(self.ngram) if self.draft is None else \
            DraftModel(self.draft, runner.spec.vocab_size, row)
        return Speculator(runner, drafter, self.draft_tokens, sampling, row)


def speculates(sampling: Sampling, adjusts_or_reports: bool) -> bool:
    """Whether a row of this sampling speculates: not where its logits are worked on or reported on the host
    (a grammar, penalties, ``logit_bias``, ``min_tokens``, logprobs: ``Control``), and not with a seed, which
    must reproduce the same tokens whether or not the server was busy enough to speculate (the rule draws
    from its own stream)."""
    return not adjusts_or_reports and (sampling.greedy or sampling.seed is None)
