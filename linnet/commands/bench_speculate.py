"""``linnet bench --speculate``: decode with and without speculation on the workload prompts."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from linnet.backends import CacheShape, create_runner
from linnet.backends.registry import get_backend
from linnet.backends.runner import Runner, cache_positions
from linnet.bench.speculation import format_rows, run_speculation_bench
from linnet.bench.workloads import chat_ids, workload_prompts
from linnet.commands._common import onnx_when_fastest
from linnet.commands._speculate import draft_tokens, make_drafter
from linnet.errors import LinnetError
from linnet.files import check_output
from linnet.model import LoadedModel, open_model
from linnet.speculative import Speculator


def handle_speculation(args: argparse.Namespace) -> int:
    if args.output:
        check_output(args.output, args.force)
    backends = args.backend or [onnx_when_fastest(args.dtype) or "torch:eager"]
    if len(backends) != 1 or args.peer:
        raise LinnetError("--speculate measures one Linnet backend (one --backend, no --peer)")
    backend = get_backend(backends[0])
    if args.threads:
        backend.package.set_threads(args.threads)
    model = open_model(args.model)
    if model.tokenizer is None:
        raise LinnetError(f"{model.path} has no tokenizer.json; the workloads are text")
    longest = max(len(chat_ids(model.tokenizer, p)) for _, p in workload_prompts(args.workload))
    positions = min(cache_positions(longest + args.new_tokens), model.spec.max_positions)

    def runner_of(m: LoadedModel) -> Runner:
        return create_runner(backend.id, m.weights, CacheShape(1, positions), args.dtype)

    runner = runner_of(model)
    runner.warm_up()
    drafter = make_drafter(args, model, runner_of)
    assert drafter is not None  # --speculate was given
    rows = run_speculation_bench(runner, model.tokenizer, lambda: Speculator(runner, drafter, draft_tokens(args)),
                                 args.workload, args.new_tokens, args.runs)
    threads = runner.describe().get("threads")
    described = (f"{model.path} on {backend.id} {args.dtype}, {threads or '?'} threads; --speculate "
                 f"{args.speculate} --draft-tokens {draft_tokens(args)}; medians of {args.runs} runs, taking turns")
    print(format_rows(rows, described))
    if args.output:
        Path(args.output).write_text(json.dumps({"model": str(model.path), "backend": backend.id, "dtype": args.dtype,
                                           "threads": threads, "load_average": os.getloadavg()[0],
                                           "speculate": args.speculate, "draft_tokens": draft_tokens(args),
                                           "rows": [r.to_json() for r in rows]}, indent=1))
        print(f"\nwrote {args.output}")
    return 0
