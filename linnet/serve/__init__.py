"""Serving: the engine (continuous batching over a runner's cache rows, thread-safe submit, stream and
cancel) and, in ``linnet.serve.app``, the OpenAI-compatible HTTP API on top of it (needs FastAPI)."""
from linnet.serve.engine import (
    CANCELLED,
    ERROR,
    LENGTH,
    STOP,
    Completion,
    Engine,
    Event,
    Params,
    QueueFull,
    Request,
    RequestError,
)
from linnet.serve.model_thread import ModelThread

__all__ = ["CANCELLED", "ERROR", "LENGTH", "STOP", "Completion", "Engine", "Event", "ModelThread", "Params",
           "QueueFull", "Request", "RequestError"]
