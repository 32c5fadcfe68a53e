"""``linnet bench``: Linnet's backends against transformers, each in its own process, on one checkpoint,
taking turns one generation at a time (``--sequential``: one subject after another)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from linnet import openmp
from linnet.backends.registry import benched_ids
from linnet.bench.all import PROFILES, TIME_LIMIT_S, AllSettings, run_all
from linnet.bench.harness import OMP_WAIT_POLICIES, Settings, run_bench
from linnet.bench.protocol import PEERS
from linnet.bench.table import format_results
from linnet.bench.workloads import WORKLOAD_NAMES
from linnet.commands._checks import add_force_argument, path, threads, whole
from linnet.commands._common import add_model_argument
from linnet.commands._speculate import add_speculation_arguments, check_speculation_arguments
from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
from linnet.files import check_output
from linnet.registry.schema import Protocol
from linnet.results import save_results


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="measure Linnet's backends and transformers on one checkpoint")
    add_model_argument(parser)
    parser.add_argument("--backend", action="append", choices=benched_ids(),
                        help="a Linnet backend (repeatable; default: all of them)")
    parser.add_argument("--peer", action="append", choices=tuple(PEERS),
                        help="a peer (repeatable; default: all of them); 'transformers' is the reference")
    parser.add_argument("--dtype", default="f32", choices=tuple(DTYPES))
    parser.add_argument("--prompt-tokens", type=whole(1), default=512)
    parser.add_argument("--new-tokens", type=whole(2), default=128,
                        help="at least 2: decode speed is timed from the first token on (default: 128)")
    parser.add_argument("--warmup", type=whole(0), default=3)
    parser.add_argument("--runs", type=whole(1), default=10)
    parser.add_argument("--threads", type=threads, default=None, help="per worker (default: every core)")
    parser.add_argument("--omp-wait-policy", default=openmp.DEFAULT, choices=OMP_WAIT_POLICIES,
                        help="how the workers' OpenMP threads wait (default: brief, a short spin then sleep; "
                             "inherit leaves the environment alone)")
    parser.add_argument("--sequential", action="store_true",
                        help="run each subject's generations together, not taking turns with the others")
    parser.add_argument("-o", "--output", type=path,
                        help="write the results JSON here (with --all: into this directory)")
    parser.add_argument("--all", action="store_true",
                        help="every row this machine can run, one subject at a time, into -o DIR (docs/BENCH.md)")
    parser.add_argument("--profile", choices=tuple(PROFILES), default="seed",
                        help="with --all: the protocol (default: seed, 512 + 128 tokens, 3 warm-ups, 10 runs)")
    parser.add_argument("--resume", action="store_true", help="with --all: run only the rows the results file lacks")
    parser.add_argument("--only", action="append", metavar="ROW",
                        help="with --all: run this row alone (repeatable), again where the file holds it; "
                             "e.g. --only vllm --only vllm:linnet-export")
    parser.add_argument("--time-limit", type=whole(1), default=TIME_LIMIT_S,
                        help=f"with --all: seconds each row may take (default: {TIME_LIMIT_S})")
    add_speculation_arguments(parser)
    parser.add_argument("--workload", choices=WORKLOAD_NAMES, default="all",
                        help="with --speculate: the prompts, one kind, 'copying' or 'all' (default: all)")
    add_force_argument(parser)
    parser.set_defaults(func=handle)


def subjects(args: argparse.Namespace) -> tuple[str, ...]:
    """The peers and Linnet backends asked for; by default every peer and every benched backend."""
    return tuple(args.peer or PEERS) + tuple(args.backend or benched_ids())


def handle(args: argparse.Namespace) -> int:
    if args.all:
        return handle_all(args)
    check_speculation_arguments(args)
    if args.speculate:
        from linnet.commands.bench_speculate import handle_speculation

        return handle_speculation(args)
    if args.output:  # before the minutes of measuring, not after
        check_output(args.output, args.force)
    protocol = Protocol(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, batch=1,
                        runs=args.runs, warmups=args.warmup)
    settings = Settings(args.model, subjects(args), protocol, args.dtype, args.threads, args.omp_wait_policy,
                        interleave=not args.sequential)
    results = run_bench(settings)
    print(format_results(results))
    if args.output:
        save_results(results, args.output)
        print(f"\nwrote {args.output}")
    failed = [r.name for r in results.rows if (r.not_run or "").startswith("failed")]
    if failed:
        print(f"linnet bench: {', '.join(failed)} failed (see the errors above)", file=sys.stderr)
    return 1 if failed else 0


def handle_all(args: argparse.Namespace) -> int:
    if not args.output:
        raise LinnetError("--all writes a results file into a directory: give it with -o DIR")
    settings = AllSettings(args.model, Path(args.output), args.profile, args.dtype, args.threads, args.time_limit,
                           args.resume, args.force, tuple(args.only or ()))
    results, path = run_all(settings)
    print(format_results(results))
    print(f"\nwrote {path}")
    return 0
