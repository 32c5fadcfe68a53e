"""Linnet's own backends as bench subjects, driven through the Runner contract only."""
from __future__ import annotations

import importlib
import time

import numpy as np

from linnet.backends import CacheShape, create_runner
from linnet.bench.protocol import Generation, Job, Subject, cache_positions
from linnet.model import open_model


class LinnetSubject(Subject):
    def __init__(self, backend: str, job: Job):
        self.backend, self.job = backend, job
        if backend != "torch:eager":
            for library in ("torch._dynamo", "torch._inductor.compile_fx"):  # imports (seconds): untimed, as all are
                importlib.import_module(library)

    def load(self) -> None:
        job = self.job
        model = open_model(job.model)
        positions = cache_positions(job.protocol.prompt_tokens, job.protocol.new_tokens)
        self.runner = create_runner(self.backend, model.weights, CacheShape(1, positions), job.dtype)

    def generate(self, prompt: list[int], new_tokens: int, record: int) -> Generation:
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
        return Generation(first - start, end - first, tokens, np.stack(kept) if kept else None)

    def peak_memory(self) -> int:
        return self.runner.peak_memory()

    def notes(self) -> list[str]:
        return [f"KV cache compiled for {self.runner.cache.positions} positions"]
