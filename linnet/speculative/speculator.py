"""One row's speculation: propose, verify in one chunk, keep what the rule accepts, adapt k."""
from __future__ import annotations

import numpy as np

from linnet.backends.runner import Runner
from linnet.errors import LinnetError
from linnet.sampling import Sampling
from linnet.speculative.proposal import Drafter
from linnet.speculative.rejection import verify


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
        if not 1 <= most < runner.prefill_chunk:
            raise LinnetError(f"--draft-tokens must be 1 to {runner.prefill_chunk - 1} (the runner's prefill chunk "
                              f"of {runner.prefill_chunk} holds the last token and the drafts), got {most}")
        self.runner, self.drafter, self.most, self.sampling, self.row = runner, drafter, most, sampling, row
        self.k = most
        self.rng = np.random.default_rng(sampling.seed)
        self.drafted = self.accepted = self.verified = 0  # drafts proposed, drafts kept, verifying calls

    def advance(self, context: list[int], room: int) -> list[int] | None:
        """The next tokens after ``context`` (the row's tokens; its last is not yet in the cache), at most
        ``room``: the kept drafts and the target's own next one. None where there is nothing to verify
        (no proposal, or room for one token only): the caller decodes one token as usual."""
        runner, row = self.runner, self.row
        length = runner.lengths[row]
        if len(context) != length + 1:
            raise LinnetError(f"row {row} holds {length} tokens; the context must be those and one more, "
                              f"got {len(context)}")
        k = min(self.k, room - 1, runner.cache.positions - length - 1)  # the chunk writes length..length + k
        if k < 1:
            return None
        proposal = self.drafter.propose(context, k, self.sampling, self.rng)
        if not proposal.tokens:
            return None
        logits = runner.prefill(row, [context[-1], *proposal.tokens], start=length, all_logits=True)
        tokens = verify(logits, proposal, self.sampling, self.rng)
        runner.lengths[row] = length + len(tokens)  # the last token and the kept drafts; the rest are not counted
        kept = len(tokens) - 1
        self.drafted += len(proposal.tokens)
        self.accepted += kept
        self.verified += 1
        self.k = min(self.most, 2 * self.k) if kept == len(proposal.tokens) else kept + 1
        return tokens

    def report(self) -> dict[str, float | int | str]:
        return {"drafter": self.drafter.name, "draft_tokens": self.most, "drafted": self.drafted,
                "accepted": self.accepted, "verify_calls": self.verified,
                "acceptance": round(self.accepted / self.drafted, 4) if self.drafted else 0.0}
