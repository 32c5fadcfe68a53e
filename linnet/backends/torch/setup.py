"""Whether the torch backend can run here, its thread pool, and the imports its compiled modes need."""
from __future__ import annotations

import importlib
import importlib.util


def unavailable(mode: str) -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch)"
    if mode == "cudagraphs":
        import torch

        if not torch.cuda.is_available():
            return "CUDA graphs need a CUDA GPU, and none is available here"
    return None


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def prepare(mode: str) -> None:
    import torch  # noqa: F401  (seconds on its own)

    if mode in ("inductor", "cudagraphs"):
        for library in ("torch._dynamo", "torch._inductor.compile_fx"):
            importlib.import_module(library)
