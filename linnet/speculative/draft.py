"""A draft model: a smaller model of the target's tokenizer, on its own runner, proposes the tokens."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from linnet.backends.runner import OK, Decode, Runner
from linnet.errors import LinnetError, UnsupportedModel
from linnet.sampling import Sampling, probabilities
from linnet.speculative.proposal import Proposal
from linnet.tokenizer import Tokenizer


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, target_name: str, draft_name: str) -> None:
    """Refuse a draft whose token ids mean other text than the target's: every id must be the same token."""
    ours, theirs = target.hf.get_vocab(with_added_tokens=True), draft.hf.get_vocab(with_added_tokens=True)
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda item: item[1])[:3]
        raise UnsupportedModel(
            f"the draft model {draft_name} does not share the tokenizer of {target_name} ({len(theirs)} tokens "
            f"against {len(ours)}; differing, e.g. {differ}); speculation needs a draft of the same tokenizer")


class DraftModel:
    """Proposes by running its own model on ``row`` of its ``runner``: it feeds the tokens the target kept
    since its last proposal (going back past the drafts the target rejected) and draws k tokens, greedy
    or with the request's sampling, whose distributions are the q of the rejection rule. ``width``: the
    target's vocabulary, which the q are fitted to (a model may pad its vocabulary)."""

    name = "draft"

    def __init__(self, runner: Runner, width: int, row: int = 0):
        self.runner, self.width, self.row = runner, width, row
        self.held: list[int] = []  # the tokens in the draft's row

    def propose(self, context: Sequence[int], k: int, sampling: Sampling, rng: np.random.Generator) -> Proposal:
        runner, row = self.runner, self.row
        common = 0
        for mine, theirs in zip(self.held, context[:-1]):
            if mine != theirs:
                break
            common += 1
        if len(context) + k - 1 > runner.cache.positions:
            raise LinnetError(f"the draft model's cache of {runner.cache.positions} positions cannot hold "
                              f"{len(context)} + {k} - 1 tokens; give it the target's")
        if runner.rings and len(self.held) - common > (runner.ring_chunk or 0):
            common = 0  # a ring keeps a position until ring_chunk later ones are written past its window
        runner.lengths[row] = common  # the rejected drafts' positions, or another request's, are not counted
        logits = runner.prefill(row, context[common:], start=common)
        self.held = list(context)
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        while True:
            if sampling.greedy:
                token = int(np.argmax(logits))
            else:
                q = np.zeros(self.width)
                fitted = probabilities(logits, sampling)[:self.width]
                q[:fitted.size] = fitted / fitted.sum()
                token = int(rng.choice(self.width, p=q))
                qs.append(q)
            tokens.append(token)
            if len(tokens) == k:
                break
            result = runner.step(decode=[Decode(row, token)], logits=True)[row]
            if result.status != OK or result.logits is None:
                raise LinnetError(f"the draft model's step failed: {result.message}")
            self.held.append(token)
            logits = result.logits
        return Proposal(tokens, np.stack(qs) if qs else None)
