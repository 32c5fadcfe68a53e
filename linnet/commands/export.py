"""``linnet export hf|gguf MODEL -o OUT``: write a model for the engines that read HF checkpoints or GGUF."""
from __future__ import annotations

import argparse
import time

from linnet.commands._checks import add_force_argument, path
from linnet.commands._common import add_model_argument
from linnet.dtypes import DTYPES
from linnet.files import check_output
from linnet.gguf.export import TYPES, export_gguf
from linnet.hf.export import export_hf
from linnet.model import open_model


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("export", help="write a model as an HF checkpoint or a GGUF file")
    formats = parser.add_subparsers(dest="format", required=True)
    hf = formats.add_parser("hf", help="an HF checkpoint directory (transformers, vLLM, SGLang, TGI)")
    add_model_argument(hf)
    hf.add_argument("-o", "--output", type=path, required=True, help="directory to create")
    hf.add_argument("--dtype", choices=DTYPES, default=None, help="weights' dtype (default: the model's)")
    add_force_argument(hf)
    gguf = formats.add_parser("gguf", help="a GGUF file (llama.cpp)")
    add_model_argument(gguf)
    gguf.add_argument("-o", "--output", type=path, required=True, help="file to write")
    gguf.add_argument("--type", choices=TYPES, default="f16", help="matrices' type (default: f16)")
    gguf.add_argument("--name", help="the file's general.name (default: the model's file or directory name)")
    add_force_argument(gguf)
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    check_output(args.output, args.force)  # before the model loads: refusing takes no time
    start = time.perf_counter()
    model = open_model(args.model)
    loaded = time.perf_counter()
    if args.format == "hf":
        kind = args.dtype or model.spec.dtype
        out = export_hf(model, args.output, kind, force=args.force)
    else:
        kind = args.type
        out = export_gguf(model, args.output, kind, force=args.force, name=args.name)
    done = time.perf_counter()
    print(f"wrote {out} ({args.format}, {kind}) in {done - loaded:.2f} s (loading took {loaded - start:.2f} s)")
    return 0
