"""Whether a provider can run here, the thread count sessions get, and the imports a load needs."""
from __future__ import annotations

import importlib.util

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
             "tensorrt": "TensorrtExecutionProvider"}
_threads = 0  # ONNX Runtime's default: one per physical core


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
    return _threads


def prepare(mode: str) -> None:
    import onnx  # noqa: F401
    import onnxruntime  # noqa: F401
