"""Speculative decoding, exact: a drafter proposes tokens, the target model checks them all in one chunk.

``Speculator`` drives one row: it asks a drafter (``PromptLookup``: the row's own earlier tokens;
``DraftModel``: a smaller model of the same tokenizer on its own runner) for up to k tokens, feeds the
row's last token and the drafts to the target as one prefill chunk with a logit per position, and keeps
what the rejection rule (``verify``) accepts, so the tokens are distributed exactly as the target's own.
docs/SPECULATIVE.md says when it pays.
"""
from __future__ import annotations

from linnet.speculative.draft import DraftModel, check_same_tokenizer
from linnet.speculative.ngram import PromptLookup
from linnet.speculative.proposal import Drafter, Proposal
from linnet.speculative.rejection import verify
from linnet.speculative.speculator import Speculator

__all__ = ["DraftModel", "Drafter", "PromptLookup", "Proposal", "Speculator", "check_same_tokenizer", "verify"]
