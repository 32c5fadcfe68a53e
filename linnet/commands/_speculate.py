"""``--speculate``: the flags of speculative decoding, and the speculator they ask for."""
from __future__ import annotations

import argparse
from collections.abc import Callable

from linnet.backends.runner import Runner
from linnet.commands._checks import whole
from linnet.errors import LinnetError
from linnet.model import LoadedModel, open_model
from linnet.sampling import Sampling
from linnet.serve.speculation import DEFAULT_ROWS, Speculation
from linnet.speculative import Drafter, DraftModel, PromptLookup, Speculator, check_same_tokenizer
from linnet.speculative.ngram import NGRAM
from linnet.speculative.speculator import DRAFT_TOKENS


def add_speculation_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                              serving: bool = False) -> None:
    """The speculation flags; ``serving``: ``linnet serve``'s, used while few rows are busy."""
    if serving:
        parser.add_argument("--speculate", default=None, metavar="ngram|MODEL",
                            help="speculative decoding, exact: 'ngram' drafts from each request's prompt and output "
                                 "(prompt lookup), or a draft MODEL of the same tokenizer (a cache row beside each of "
                                 "the target's), while at most --speculate-rows rows are busy (docs/SPECULATIVE.md)")
        parser.add_argument("--speculate-rows", type=whole(1), default=None, metavar="N",
                            help=f"with --speculate: speculate while at most N rows are busy (default: {DEFAULT_ROWS})")
    else:
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


def serving_speculation(args: argparse.Namespace) -> Speculation | None:
    """``linnet serve``'s speculation from its flags, or None; what it cannot do is refused by name."""
    check_speculation_arguments(args)
    if args.speculate is None:
        if args.speculate_rows is not None:
            raise LinnetError("--speculate-rows only applies with --speculate")
        return None
    if getattr(args, "num_processes", 1) > 1:
        raise LinnetError("--speculate does not run with --num-processes: the other processes follow process 0's "
                          "batched steps only")
    return Speculation(draft_tokens(args), args.ngram or NGRAM, args.speculate_rows or DEFAULT_ROWS)


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
    draft = open_draft(args, model)
    assert draft is not None
    return DraftModel(make_runner(draft), model.spec.vocab_size)


def open_draft(args: argparse.Namespace, model: LoadedModel) -> LoadedModel | None:
    """The draft model ``--speculate MODEL`` names, its tokenizer checked to be the target's; None for none."""
    if args.speculate in (None, "ngram"):
        return None
    draft = open_model(args.speculate)
    if model.tokenizer is None or draft.tokenizer is None:
        raise LinnetError(f"the draft model {draft.path} and the target need a tokenizer.json each, to check "
                          "that they share one")
    check_same_tokenizer(model.tokenizer, draft.tokenizer, str(model.path), str(draft.path))
    return draft
