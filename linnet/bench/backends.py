"""Linnet's own backends as bench subjects, any of the registry's, driven through the Runner contract only."""
from __future__ import annotations

import os
import time

import numpy as np

from linnet.backends.registry import Backend
from linnet.backends.runner import CacheShape, Decode, Prefill, cache_positions
from linnet.bench.bandwidth import BLOCKS_NOTE
from linnet.bench.protocol import Job, Subject, TimedGeneration
from linnet.errors import BackendUnavailable
from linnet.model import open_model


class LinnetSubject(Subject):
    def __init__(self, backend: Backend, job: Job):
        reason = backend.unavailable()
        if reason is None and job.dtype not in backend.dtypes:
            reason = f"{backend.id} does not run {job.dtype}; it runs {', '.join(backend.dtypes)}"
        if reason:
            raise BackendUnavailable(reason)  # a row "not run" with the reason, never an estimate
        self.backend, self.job = backend, job
        threads = os.environ.get("OMP_NUM_THREADS")  # the bench's thread count (harness.worker_environment)
        if threads:  # for the runtimes that keep their own pools (ONNX Runtime, XLA), as `--threads` does
            backend.package.set_threads(int(threads))
        backend.prepare()  # imports its load would otherwise pay inside the load clock: untimed, as all are

    def load(self) -> None:
        job = self.job
        model = open_model(job.model)
        positions = cache_positions(job.protocol.prompt_tokens + job.protocol.new_tokens)
        self.runner = self.backend.create(model.weights, CacheShape(1, positions), job.dtype)

    def generate(self, prompt: list[int], new_tokens: int, record: int) -> TimedGeneration:
        """Greedy through the batched step, as a server drives it: the token is chosen where the model runs,
        and logits come to the host only for the ``record`` steps compared with the reference."""
        runner, kept = self.runner, []

        def pick(result) -> int:
            if result.logits is not None:
                kept.append(result.logits)
            return result.token

        runner.reset(0)
        start = time.perf_counter()
        tokens = [pick(runner.step(prefill=[Prefill(0, prompt)], logits=record > 0)[0])]
        first = time.perf_counter()
        while len(tokens) < new_tokens:
            tokens.append(pick(runner.step(decode=[Decode(0, tokens[-1])], logits=len(kept) < record)[0]))
        end = time.perf_counter()
        return TimedGeneration(first - start, end - first, tokens, np.stack(kept) if kept else None)

    def peak_memory(self) -> int:
        return self.runner.peak_memory()

    def notes(self) -> list[str]:
        described = self.runner.describe()  # "blocks": a runner multiplying llama.cpp's blocks, and how
        blocks = ([f"{BLOCKS_NOTE} ({described['blocks']}), {described['block_products']}"]
                  if "blocks" in described else [])
        runner = self.runner
        rings = (f" (sliding layers keep rings of {', '.join(str(slots) for slots, _ in sorted(runner.rings))} "
                 "positions)") if runner.rings else ""
        return [f"KV cache compiled for {runner.cache.positions} positions, {runner.cache_bytes_per_row} bytes a "
                f"row in {runner.cache_dtype}{rings}", *blocks]
