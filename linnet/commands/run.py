"""``linnet run``: generate from a prompt or a chat message, streaming the text, then a summary."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, cast

from linnet.backends.runner import Runner, cache_positions
from linnet.commands._cache import check_cache_memory, check_positions
from linnet.commands._checks import message, number, seed, whole
from linnet.commands._common import (
    add_model_argument,
    add_runner_arguments,
    check_process_arguments,
    make_runner,
    onnx_when_fastest,
)
from linnet.commands._speculate import (
    add_speculation_arguments,
    check_speculation_arguments,
    draft_tokens,
    make_speculator,
)
from linnet.errors import LinnetError
from linnet.generation import Sampling, generate
from linnet.model import LoadedModel, open_model

if TYPE_CHECKING:
    from linnet.backends.torch.runner import TorchRunner


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("run", help="generate text from a prompt or chat message")
    add_model_argument(parser)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--prompt", type=message, help="plain text prompt")
    what.add_argument("--chat", type=message, help="a user message, wrapped in the model's chat template")
    parser.add_argument("--system", type=message, help="system message for --chat")
    add_runner_arguments(parser)
    parser.add_argument("--max-new-tokens", type=whole(1), default=128)
    parser.add_argument("--temperature", type=number(0, 100), default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-k", type=whole(0), default=0, help="0 keeps every token (default)")
    parser.add_argument("--top-p", type=number(0, 1, low_open=True), default=1.0)
    parser.add_argument("--seed", type=seed, default=None, help="0 to 2^63 - 1 (default: a random one)")
    parser.add_argument("--stop", type=message, action="append", default=[], help="stop string (repeatable)")
    add_speculation_arguments(parser)
    parser.add_argument("--cache-positions", type=whole(2), default=None,
                        help="KV cache length, at most the model's maximum positions (default: prompt + new "
                        "tokens, rounded up to 128)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    parser.set_defaults(func=handle, backend=None)  # None: the fastest this machine is ready to run (pick_runner)


def handle(args: argparse.Namespace) -> int:
    if args.prompt is None and args.chat is None:
        raise LinnetError('give a prompt: --chat "a message" (wrapped in the model\'s chat template) or '
                          '--prompt "text to continue"')
    if args.system is not None and args.chat is None:
        raise LinnetError("--system is the system message of --chat; with --prompt, write it into the prompt")
    check_speculation_arguments(args)
    check_process_arguments(args)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    if args.num_processes > 1:
        check_same_draws(args, sampling)
    # with --num-processes, every process runs this same loop; process 0 alone shows the text
    worker = bool(args.process_id)
    model = open_model(args.model)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise LinnetError(f"{model.path} has no tokenizer.json; linnet run needs one")
    if args.chat is not None:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        prompt_ids = tokenizer.encode_chat([*messages, {"role": "user", "content": args.chat}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    most = model.spec.max_positions
    if args.cache_positions is not None:
        check_positions("--cache-positions", args.cache_positions, model.spec)
    needed = len(prompt_ids) + args.max_new_tokens - 1  # the last new token is never stored
    if needed > most:
        raise LinnetError(f"the prompt's {len(prompt_ids)} tokens and up to {args.max_new_tokens} new tokens need "
                          f"{len(prompt_ids)} + {args.max_new_tokens} - 1 = {needed} positions, more than the "
                          f"model's {most}; shorten the prompt or lower --max-new-tokens")
    positions = args.cache_positions or min(cache_positions(len(prompt_ids) + args.max_new_tokens), most)
    check_cache_memory(model.spec, args.dtype, args.backend, 1, positions, "--cache-positions")
    runner = pick_runner(model, args, positions)
    # compiling (or loading compiled code) is timed apart from the request, speculation's checks included
    warm_up_s = runner.warm_up(verify=(1, draft_tokens(args) + 1) if args.speculate else None)
    compile_s = getattr(runner, "compile_time", 0.0)

    shown: list[str] = []  # the text so far: what an interrupted run still reports

    def show(text: str) -> None:
        shown.append(text)
        if not args.json and not worker:
            sys.stdout.write(text)
            sys.stdout.flush()

    speculator = make_speculator(args, model, runner, sampling, lambda draft: make_runner(draft, args, positions))
    try:
        result = generate(runner, prompt_ids, args.max_new_tokens, sampling, tokenizer=tokenizer, stop=args.stop,
                          on_text=show, speculator=speculator)
    except KeyboardInterrupt:  # what was generated is kept: the line ended, or the JSON marked interrupted
        if args.json:
            print(json.dumps({"prompt_ids": prompt_ids, "text": "".join(shown), "finish_reason": "interrupted",
                              "model": str(model.path), "backend": args.backend, "dtype": args.dtype}))
        else:
            end_line(shown)
        raise
    summary = {
        "model": str(model.path),
        "backend": args.backend,
        "dtype": args.dtype,
        "threads": runner.describe().get("threads"),
        "load_average": os.getloadavg()[0],
        "load_s": round(runner.load_time, 4),
        "compile_s": round(compile_s, 4),
        "warm_up_s": round(warm_up_s, 4),
        "ttft_ms": round(result.ttft_s * 1000, 2),
        "decode_tok_s": round(result.decode_tok_s, 2),
        "new_tokens": len(result.token_ids),
        "finish_reason": result.finish_reason,
        **({"speculation": speculator.report()} if speculator else {}),
    }
    if args.num_processes > 1:
        summary.update(num_processes=args.num_processes, process_id=args.process_id,
                       devices=runner.describe().get("devices"))
    if args.json:  # every process prints its own, for the script that started them
        print(json.dumps({"prompt_ids": prompt_ids, "token_ids": result.token_ids, "text": result.text, **summary}))
    elif worker:
        print(f"linnet run: process {args.process_id} of {args.num_processes} done ({summary['new_tokens']} tokens); "
              "process 0 shows the text", file=sys.stderr)
    else:
        end_line(shown)
        threads = f"{summary['threads']} threads, " if summary["threads"] else ""
        decode = f"{summary['decode_tok_s']:.1f} tok/s" if summary["new_tokens"] > 1 else "– (one token)"
        if speculator:
            decode += (f" ({speculator.drafter.name} drafts: {speculator.accepted} of {speculator.drafted} "
                       "accepted)")
        print(
            f"\n[{summary['new_tokens']} tokens, {summary['finish_reason']} · first token {summary['ttft_ms']:.0f} ms"
            f" · decode {decode} · load {summary['load_s']:.2f} s"
            f" + compiled steps {summary['compile_s']:.2f} s"
            f" + warm-up {summary['warm_up_s'] - summary['compile_s']:.2f} s"
            f" · {args.backend} {args.dtype}, {threads}load average {summary['load_average']:.2f}]",
            file=sys.stderr,
        )
    if getattr(args, "note", None):  # after the run, so that an error stays the first line
        print(args.note, file=sys.stderr)
    return 0


def check_same_draws(args: argparse.Namespace, sampling: Sampling) -> None:
    """Every process must draw the same tokens, or their steps part ways: greedy, or sampling from one seed
    that every process is given (the logits are the same in each)."""
    if not sampling.greedy and args.seed is None:
        raise LinnetError("--num-processes with --temperature above 0 needs --seed, the same in every process, so "
                          "that every process draws the same tokens")
    if args.speculate is not None:
        raise LinnetError("--speculate runs in one process; leave it out with --num-processes")


def end_line(shown: list[str]) -> None:
    """End the text's last line on stdout: a file or pipe it went to holds whole lines."""
    if "".join(shown)[-1:] not in ("", "\n"):
        print(flush=True)


def pick_runner(model: LoadedModel, args: argparse.Namespace, positions: int) -> Runner:
    """The runner of ``--backend``; without one, the fastest this machine is ready to run: onnx:cpu where
    it is (``onnx_when_fastest``); else torch:inductor on a CPU once its compiled steps for this model
    and cache size are on disk (ready in well under a second, decoding faster than eager), else
    torch:eager. Compiling takes minutes, more than a short run gains, so it is the user's choice, said
    once (docs/COMPILED.md)."""
    if args.backend is not None:
        return make_runner(model, args, positions)
    args.backend = onnx_when_fastest(args.dtype)
    if args.backend:
        return make_runner(model, args, positions)
    args.backend = "torch:inductor"
    runner = cast("TorchRunner", make_runner(model, args, positions))
    if runner.compiled_on_disk() or runner.device.type != "cpu":
        return runner
    args.backend = "torch:eager"
    args.note = ("linnet: ran torch:eager; `linnet run --backend torch:inductor` compiles this model's steps once "
                 "(minutes), after which linnet run uses them, ready in under a second")
    return make_runner(model, args, positions)
