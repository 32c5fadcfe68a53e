"""One row's speculation: propose, verify in one chunk, keep what the rule accepts, adapt k."""
from __future__ import annotations

import numpy as np

from linnet.backends.runner import Runner
from linnet.errors import LinnetError
from linnet.sampling import Sampling
from linnet.speculative.proposal import Drafter, Proposal
from linnet.speculative.rejection import verify

DRAFT_TOKENS = 8  # the most drafts checked in one call, by default


class Speculator:
    """Advances ``row`` of the target ``runner`` by several tokens a model call where the drafts agree.

    The row's last token and k drafts go in as one prefill chunk at the row's length, with a logit per
    position; the rejected drafts' positions are then not counted (the row's length goes back), and
    since every position is written before any query reads it, nothing needs clearing. A chunk of
    k + 1 <= the runner's ``prefill_chunk`` keeps sliding layers' ring caches whole, going back included
    (``linnet.program.rings``). k doubles while every draft is kept, up to ``most``, and falls to one
    past the drafts kept, so a row with nothing to copy costs little. The rule's draws come from this
    speculator's own random stream, seeded by the request: a seed reproduces a run.
    """

    def __init__(self, runner: Runner, drafter: Drafter, most: int, sampling: Sampling = Sampling(), row: int = 0):
        check_draft_tokens(most, runner)
        self.runner, self.drafter, self.most, self.sampling, self.row = runner, drafter, most, sampling, row
        self.k = most
        self.rng = np.random.default_rng(sampling.seed)
        self.drafted = self.accepted = self.verified = 0  # drafts proposed, drafts kept, verifying calls
        self.start = 0  # the row's length when the last proposal was made: where its chunk was written

    def advance(self, context: list[int], room: int) -> list[int] | None:
        """The next tokens after ``context`` (the row's tokens; its last is not yet in the cache), at most
        ``room``: the kept drafts and the target's own next one. None where there is nothing to verify
        (no proposal, or room for one token only): the caller decodes one token as usual."""
        proposal = self.propose(context, room)
        if proposal is None:
            return None
        return self.settle(self.runner.verify({self.row: [context[-1], *proposal.tokens]})[self.row], proposal)

    def propose(self, context: list[int], room: int) -> Proposal | None:
        """The drafts to check after ``context`` (the row's tokens; its last is not yet in the cache), leaving
        room for the target's own token within ``room`` and the row; None where there are none. The caller
        feeds ``[context[-1], *drafts]`` at the row's length with every position's logits, then ``settle``s."""
        length = self.runner.lengths[self.row]
        if len(context) != length + 1:
            raise LinnetError(f"row {self.row} holds {length} tokens; the context must be those and one more, "
                              f"got {len(context)}")
        k = min(self.k, room - 1, self.runner.cache.positions - length - 1)  # the chunk writes length..length + k
        if k < 1:
            return None
        proposal = self.drafter.propose(context, k, self.sampling, self.rng)
        self.start = length
        return proposal if proposal.tokens else None

    def settle(self, logits: np.ndarray, proposal: Proposal) -> list[int]:
        """The tokens the rule keeps from the target's ``logits`` [k + 1, vocab] over the row's last token and
        the drafts, the target's own last; the row's length then counts the last token and the kept drafts
        (the rejected ones' positions are not counted), and k adapts."""
        tokens = verify(logits, proposal, self.sampling, self.rng)
        self.runner.lengths[self.row] = self.start + len(tokens)  # the last token and the kept drafts were written
        kept = len(tokens) - 1
        self.drafted += len(proposal.tokens)
        self.accepted += kept
        self.verified += 1
        self.k = min(self.most, 2 * self.k) if kept == len(proposal.tokens) else kept + 1
        return tokens

    def settle_one(self, logits: np.ndarray) -> list[int]:
        """The target's next token from ``logits`` [1, vocab] over the row's last token, checked without
        drafts beside rows that had some (``linnet serve``: one call for every speculating row); the row's
        length counts the token, and k stays."""
        tokens = verify(logits[:1], Proposal([]), self.sampling, self.rng)
        self.runner.lengths[self.row] += 1
        return tokens

    def report(self) -> dict[str, float | int | str]:
        return {"drafter": self.drafter.name, "draft_tokens": self.most, "drafted": self.drafted,
                "accepted": self.accepted, "verify_calls": self.verified,
                "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else 0.0}


def check_draft_tokens(most: int, runner: Runner) -> None:
    """Refuse draft counts the runner cannot check in one call: its prefill chunk holds the last token and the
    drafts."""
    if not 1 <= most < runner.prefill_chunk:
        raise LinnetError(f"--draft-tokens must be 1 to {runner.prefill_chunk - 1} (the runner's prefill chunk "
                          f"of {runner.prefill_chunk} holds the last token and the drafts), got {most}")
