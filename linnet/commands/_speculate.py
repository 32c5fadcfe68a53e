"""``--speculate``: the flags of speculative decoding, and the speculator they ask for."""
from __future__ import annotations

import argparse
from collections.abc import Callable

from linnet.backends.runner import Runner
from linnet.commands._checks import whole
from linnet.errors import LinnetError
from linnet.model import LoadedModel, open_model
from linnet.sampling import Sampling
from linnet.speculative import Drafter, DraftModel, PromptLookup, Speculator, check_same_tokenizer

DRAFT_TOKENS, NGRAM = 8, 3


def add_speculation_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculate", default=None, metavar="ngram|MODEL",
                        help="speculative decoding, exact: 'ngram' drafts from the prompt and output (prompt "
                             "lookup), or a draft MODEL of the same tokenizer (docs/SPECULATIVE.md)")
    parser.add_argument("--draft-tokens", type=whole(1), default=None,
                        help=f"with --speculate: the most drafted tokens checked in one call (default: {DRAFT_TOKENS})")
    parser.add_argument("--ngram", type=whole(1), default=None,
                        help=f"with --speculate ngram: the longest n-gram looked up (default: {NGRAM})")


def draft_tokens(args: argparse.Namespace) -> int:
    return args.draft_tokens or DRAFT_TOKENS


def check_speculation_arguments(args: argparse.Namespace) -> None:
    """Refuse the speculation flags that would otherwise do nothing."""
    if args.speculate is None:
        given = [flag for flag, value in (("--draft-tokens", args.draft_tokens), ("--ngram", args.ngram)) if value]
        if given:
            raise LinnetError(f"{' and '.join(given)} only appl{'y' if len(given) > 1 else 'ies'} with --speculate")
    elif args.speculate != "ngram" and args.ngram is not None:
        raise LinnetError("--ngram applies to --speculate ngram, not to a draft model")


def make_speculator(args: argparse.Namespace, model: LoadedModel, runner: Runner, sampling: Sampling,
                    make_runner: Callable[[LoadedModel], Runner]) -> Speculator | None:
    """The speculator ``--speculate`` asks for, or None. ``make_runner(model)``: a runner for a draft model,
    on the target's backend, dtype and cache positions."""
    drafter = make_drafter(args, model, make_runner)
    return None if drafter is None else Speculator(runner, drafter, draft_tokens(args), sampling)


def make_drafter(args: argparse.Namespace, model: LoadedModel,
                 make_runner: Callable[[LoadedModel], Runner]) -> Drafter | None:
    check_speculation_arguments(args)
    if args.speculate is None:
        return None
    if args.speculate == "ngram":
        return PromptLookup(args.ngram or NGRAM)
    draft = open_model(args.speculate)
    if model.tokenizer is None or draft.tokenizer is None:
        raise LinnetError(f"the draft model {draft.path} and the target need a tokenizer.json each, to check "
                          "that they share one")
    check_same_tokenizer(model.tokenizer, draft.tokenizer, str(model.path), str(draft.path))
    return DraftModel(make_runner(draft), model.spec.vocab_size)
