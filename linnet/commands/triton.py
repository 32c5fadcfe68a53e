"""``linnet triton MODEL -o REPO``: a Triton model repository whose Python-backend model hosts linnet.serve."""
from __future__ import annotations

import argparse
from pathlib import Path

from linnet.backends import backend_ids
from linnet.commands._checks import add_force_argument, path, whole
from linnet.commands._common import add_model_argument
from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
from linnet.files import atomic_write, check_output
from linnet.model import open_spec
from linnet.serve.engine import STEP_PROMPT_TOKENS


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("triton", help="write a Triton model repository that serves the model with linnet.serve")
    add_model_argument(parser)
    parser.add_argument("-o", "--output", type=path, required=True, help="the repository directory to write")
    parser.add_argument("--name", default="linnet", help="the model's name in the repository (default: linnet)")
    parser.add_argument("--backend", default="torch:eager", choices=backend_ids())
    parser.add_argument("--dtype", default="f32", choices=tuple(DTYPES))
    parser.add_argument("--rows", type=whole(1), default=64, help="cache rows: requests generating at once")
    parser.add_argument("--positions", type=whole(2), default=640, help="positions per row: prompt + new tokens")
    parser.add_argument("--max-queue", type=whole(0), default=256, help="requests that may wait for a row")
    parser.add_argument("--prefill-tokens", type=whole(1), default=STEP_PROMPT_TOKENS,
                        help="prompt tokens a step reads over all rows (default %(default)s)")
    parser.add_argument("--threads", type=whole(0), default=0, help="CPU threads (default 0: the backend's choice)")
    add_force_argument(parser)
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from linnet.triton import Settings, write_repository

    check_output(args.output, args.force)  # before anything loads: refusing takes no time
    if not args.name or "/" in args.name or args.name.startswith("."):
        raise LinnetError(f"--name {args.name!r} cannot name a directory in the repository")
    spec = open_spec(args.model)  # the model must open here, not first inside Triton
    if args.positions > spec.max_positions:
        raise LinnetError(f"--positions {args.positions} is more than the model's {spec.max_positions}")
    local = Path(args.model)
    model = str(local.resolve()) if local.exists() else args.model  # a path works from Triton's directory too
    settings = Settings(model, args.backend, args.dtype, args.rows, args.positions, args.max_queue, args.threads,
                        args.prefill_tokens)
    out = Path(args.output)
    written: list[str] = []

    def write(tmp: Path) -> None:
        tmp.mkdir()
        written.extend(write_repository(tmp, args.name, settings))

    atomic_write(out, write)
    print(f"wrote {', '.join(f'{out}/{name}' for name in written)}")
    return 0
