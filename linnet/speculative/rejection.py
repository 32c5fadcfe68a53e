"""The verification rule: which drafts the target keeps, and the token it adds."""
from __future__ import annotations

import numpy as np

from linnet.sampling import Sampling, probabilities
from linnet.speculative.proposal import Proposal


def verify(logits: np.ndarray, proposal: Proposal, sampling: Sampling, rng: np.random.Generator) -> list[int]:
    """The kept drafts and one token more, from the target's ``logits`` [k + 1, vocab] at the row's last
    token and at each draft. Greedy: the longest prefix agreeing with the target's argmax, then its
    argmax. Sampling: the standard rejection rule (draft d kept with probability min(1, p(d) / q(d)), else
    a token from the normalised max(0, p - q), and after k kept a token from p), which leaves the tokens
    distributed exactly as the target's own (Leviathan et al., 2023; Chen et al., 2023)."""
    drafts = proposal.tokens
    if sampling.greedy:
        best = np.argmax(logits, axis=-1)
        kept = 0
        while kept < len(drafts) and best[kept] == drafts[kept]:
            kept += 1
        return [*drafts[:kept], int(best[kept])]
    out: list[int] = []
    for i, draft in enumerate(drafts):
        p = probabilities(logits[i], sampling)
        q = one_hot(draft, p.size) if proposal.q is None else proposal.q[i]
        if rng.random() < min(1.0, p[draft] / q[draft]):  # q[draft] > 0: the draft was drawn from q
            out.append(draft)
            continue
        rest = np.maximum(p - q, 0.0)
        # a rejection has p(d) < q(d), so rest holds mass; rounding alone could leave none
        rest = rest / rest.sum() if rest.sum() > 0 else p
        return [*out, int(rng.choice(rest.size, p=rest))]
    p = probabilities(logits[len(drafts)], sampling)
    return [*out, int(rng.choice(p.size, p=p))]


def one_hot(token: int, size: int) -> np.ndarray:
    q = np.zeros(size)
    q[token] = 1.0
    return q
