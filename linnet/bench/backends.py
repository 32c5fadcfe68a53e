"""Linnet's own backends as bench subjects, any of the registry's, driven through the Runner contract only."""
from __future__ import annotations

import importlib
import time

import numpy as np

from linnet.backends.registry import Backend
from linnet.backends.runner import CacheShape, cache_positions
from linnet.bench.protocol import Job, Subject, TimedGeneration
from linnet.errors import BackendUnavailable
from linnet.model import open_model

# Libraries a backend's load would import (seconds) inside the load clock; imported first, untimed, as all are.
UNTIMED_IMPORTS = {
    "torch:inductor": ("torch._dynamo", "torch._inductor.compile_fx"),
    "torch:cudagraphs": ("torch._dynamo", "torch._inductor.compile_fx"),
}


class LinnetSubject(Subject):
    def __init__(self, backend: Backend, job: Job):
        reason = backend.unavailable()
        if reason is None and job.dtype not in backend.dtypes:
            reason = f"{backend.id} does not run {job.dtype}; it runs {', '.join(backend.dtypes)}"
        if reason:
            raise BackendUnavailable(reason)  # a row "not run" with the reason, never an estimate
        self.backend, self.job = backend, job
        for library in UNTIMED_IMPORTS.get(backend.id, ()):
            importlib.import_module(library)

    def load(self) -> None:
        job = self.job
        model = open_model(job.model)
        positions = cache_positions(job.protocol.prompt_tokens + job.protocol.new_tokens)
        self.runner = self.backend.create(model.weights, CacheShape(1, positions), job.dtype)

    def generate(self, prompt: list[int], new_tokens: int, record: int) -> TimedGeneration:
        runner, kept = self.runner, []

        def pick(logits: np.ndarray) -> int:
            if len(kept) < record:
                kept.append(np.array(logits, dtype=np.float32))  # a copy: a backend may reuse its buffer
            return int(np.argmax(logits))

        runner.reset(0)
        start = time.perf_counter()
        tokens = [pick(runner.prefill(0, prompt))]
        first = time.perf_counter()
        while len(tokens) < new_tokens:
            tokens.append(pick(runner.decode([tokens[-1]])[0]))
        end = time.perf_counter()
        return TimedGeneration(first - start, end - first, tokens, np.stack(kept) if kept else None)

    def peak_memory(self) -> int:
        return self.runner.peak_memory()

    def notes(self) -> list[str]:
        return [f"KV cache compiled for {self.runner.cache.positions} positions"]
