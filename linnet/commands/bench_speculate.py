"""``linnet bench --speculate``: decode with and without speculation on the workload prompts."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path

from linnet.backends import CacheShape, create_runner
from linnet.backends.registry import get_backend
from linnet.backends.runner import Runner, cache_positions
from linnet.bench.peers_llamacpp_lookup import LlamaCppLookup
from linnet.bench.speculation import format_rows, run_speculation_bench
from linnet.bench.workloads import chat_ids, workload_prompts
from linnet.commands._common import onnx_when_fastest
from linnet.commands._speculate import draft_tokens, make_drafter
from linnet.errors import LinnetError
from linnet.files import check_output
from linnet.model import LoadedModel, open_model
from linnet.speculative import Speculator
from linnet.speculative.ngram import NGRAM


def handle_speculation(args: argparse.Namespace) -> int:
    if args.output:
        check_output(args.output, args.force)
    backends = args.backend or [onnx_when_fastest(args.dtype) or "torch:eager"]
    if len(backends) != 1:
        raise LinnetError("--speculate measures one Linnet backend (one --backend)")
    if args.peer and args.peer != ["llama.cpp"]:
        raise LinnetError("--speculate runs one peer beside Linnet, llama.cpp's prompt lookup (--peer llama.cpp), "
                          f"not {', '.join(p for p in args.peer if p != 'llama.cpp')}")
    if args.peer and args.speculate != "ngram":
        raise LinnetError("--peer llama.cpp compares prompt lookup: it needs --speculate ngram")
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
    runner.warm_up(verify=(1, draft_tokens(args) + 1))
    drafter = make_drafter(args, model, runner_of)
    assert drafter is not None  # --speculate was given
    threads = runner.describe().get("threads")
    with ExitStack() as scratch:
        peer = None
        if args.peer:
            peer = LlamaCppLookup(_gguf_of(model, args.dtype, scratch), int(threads or os.cpu_count() or 1),
                                  positions, draft_tokens(args), args.ngram or NGRAM)
        rows = run_speculation_bench(runner, model.tokenizer,
                                     lambda: Speculator(runner, drafter, draft_tokens(args)),
                                     args.workload, args.new_tokens, args.runs, peer)
    described = (f"{model.path} on {backend.id} {args.dtype}, {threads or '?'} threads; --speculate "
                 f"{args.speculate} --draft-tokens {draft_tokens(args)}; medians of {args.runs} runs, taking turns")
    if peer is not None:
        read = "the same GGUF file" if model.path.is_file() else "its GGUF export"
        described += f"\nbeside {peer.described}, on {read}"
    print(format_rows(rows, described))
    if args.output:
        Path(args.output).write_text(json.dumps({"model": str(model.path), "backend": backend.id, "dtype": args.dtype,
                                           "threads": threads, "load_average": os.getloadavg()[0],
                                           "speculate": args.speculate, "draft_tokens": draft_tokens(args),
                                           "peer": peer.described if peer is not None else None,
                                           "rows": [r.to_json() for r in rows]}, indent=1))
        print(f"\nwrote {args.output}")
    return 0


def _gguf_of(model: LoadedModel, dtype: str, scratch: ExitStack) -> Path:
    """The GGUF file llama.cpp reads: the model's own, or a Hugging Face directory written as GGUF in the
    run's dtype (as ``linnet export gguf`` does) into a folder that is removed afterwards."""
    if model.path.is_file():
        return model.path
    from linnet.gguf.export import export_gguf

    path = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="linnet-lookup-"))) / "model.gguf"
    export_gguf(model, path, dtype)
    return path
