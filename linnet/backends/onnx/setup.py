"""Whether a provider can run here, the thread count sessions get, and the imports a load needs."""
from __future__ import annotations

import importlib.util
import os

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
             "tensorrt": "TensorrtExecutionProvider"}
_threads = 0  # 0: every CPU this process may run on (ONNX Runtime's own default counts physical cores only)


def unavailable(mode: str) -> str | None:
    if importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None:
        return "onnxruntime and onnx are not installed (pip install onnxruntime onnx)"
    import onnxruntime

    provider = PROVIDERS[mode]
    available = onnxruntime.get_available_providers()
    if provider not in available:
        gpu = " and a GPU (pip install onnxruntime-gpu)" if mode != "cpu" else ""
        return f"this onnxruntime has no {provider} (it has {', '.join(available)}); it needs one built with it{gpu}"
    return None


def set_threads(n: int) -> None:
    global _threads
    _threads = n


def threads() -> int:
    return _threads or len(os.sched_getaffinity(0))


def prepare(mode: str) -> None:
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401
