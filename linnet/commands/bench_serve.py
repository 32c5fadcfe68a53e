"""``linnet bench-serve``: servers (linnet serve, alone, under a JSON schema or through Ray Serve; Triton hosting
it; transformers serve; vLLM), one at a time, each driven over HTTP by the same requests and timed at the
client."""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from linnet.bench.serving import PROFILES, ServingProfile, format_serving, serving_results
from linnet.bench.serving_servers import NotRunnable, server_ids
from linnet.commands._checks import add_force_argument, path, text, threads, whole
from linnet.commands._common import add_model_argument
from linnet.commands.serve import default_backend
from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
from linnet.files import check_output
from linnet.model import resolve
from linnet.results import save_results


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench-serve", help="measure servers under many concurrent requests")
    add_model_argument(parser)
    parser.add_argument("--server", type=text, action="append", metavar="SERVER",
                        help="linnet:BACKEND, ray:BACKEND (linnet serve --replicas through Ray Serve), "
                             "triton:BACKEND (tritonserver hosting linnet.serve), transformers or vllm (repeatable; "
                             "default: linnet serve's own default backend); +json after a linnet or ray server "
                             "(linnet:onnx:cpu+json) constrains every request by a JSON schema; +round-robin after a "
                             "ray server routes its replicas' requests in turn, not by prompt prefix; +ngram after a "
                             "linnet or ray server speculates (linnet serve --speculate ngram); the peers need MODEL "
                             "as a Hugging Face directory (`linnet export hf`)")
    parser.add_argument("--profile", choices=tuple(PROFILES),
                        help="; ".join(f"{p.name}: {p.describe()}" for p in PROFILES.values()))
    parser.add_argument("--requests", type=whole(1), help="requests in all (default: the profile's)")
    parser.add_argument("--prompt-tokens", metavar="MIN-MAX",
                        help="prompt lengths, e.g. 128-512 (cpu-turns: a conversation's opening)")
    parser.add_argument("--new-tokens", type=whole(1), help="tokens each request returns")
    parser.add_argument("--concurrency", type=whole(1), help="requests in flight at most, and the servers' rows")
    parser.add_argument("--dtype", default="f32", choices=tuple(DTYPES))
    parser.add_argument("--threads", type=threads, default=None, help="per server (default: every core)")
    parser.add_argument("--rounds", type=whole(1), default=1,
                        help="measure every server this many times, every other round in the reverse order; a row "
                             "holds the median over rounds (default: 1)")
    parser.add_argument("--replicas", type=whole(1), default=1,
                        help="replicas of a ray:BACKEND server, sharing its --threads (default: 1)")
    parser.add_argument("--model-id", type=text,
                        help="the registry id the results name (default: MODEL's registry name, else its file or "
                             "folder name)")
    parser.add_argument("-o", "--output", type=path, help="write the results JSON here")
    add_force_argument(parser)
    parser.set_defaults(func=handle)


def profile_of(args: argparse.Namespace) -> ServingProfile:
    """The named profile (default: the seed's), with any of its numbers given on the command line."""
    base = PROFILES[args.profile or "seed"]
    low, high = base.prompt_min, base.prompt_max
    if args.prompt_tokens:
        try:
            low, high = (int(x) for x in args.prompt_tokens.split("-")) if "-" in args.prompt_tokens \
                else (int(args.prompt_tokens),) * 2
        except ValueError:
            raise LinnetError(f"--prompt-tokens: expected MIN-MAX, got {args.prompt_tokens!r}") from None
        if not 1 <= low <= high:
            raise LinnetError(f"--prompt-tokens: need 1 <= MIN <= MAX, got {args.prompt_tokens!r}")
    changed = any(v is not None for v in (args.requests, args.prompt_tokens, args.new_tokens, args.concurrency))
    return replace(base, name=f"{base.name}, changed" if changed else base.name,  # keeps its turns
                   requests=args.requests or base.requests, prompt_min=low, prompt_max=high,
                   new_tokens=args.new_tokens or base.new_tokens, concurrency=args.concurrency or base.concurrency,
                   shared=min(base.shared, low))


def handle(args: argparse.Namespace) -> int:
    if args.output:  # before the minutes of measuring, not after
        check_output(args.output, args.force)
    servers = args.server or [f"linnet:{default_backend(args.dtype)}"]
    for spec in servers:  # a typo is an error now, not a row "not run" after minutes of measuring the others
        try:
            server_ids(spec, args.replicas)
        except NotRunnable as e:
            raise LinnetError(f"--server: {e}") from None
    profile = profile_of(args)
    model_id = args.model_id or (args.model if not Path(args.model).exists() else resolve(args.model).name)
    results = serving_results(args.model, model_id, servers, profile, args.dtype, args.threads, rounds=args.rounds,
                              replicas=args.replicas)
    print(format_serving(results, profile))
    if args.output:
        save_results(results, args.output)
        print(f"\nwrote {args.output}")
    failed = [r.name for r in results.rows if (r.not_run or "").startswith("failed")]
    return 1 if failed else 0
