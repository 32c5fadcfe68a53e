"""``reference:numpy``: the Program interpreted in NumPy, float32, on the host; slow and plain."""
from __future__ import annotations

import time

import numpy as np

from linnet.backends.reference.interpreter import run_step
from linnet.backends.runner import CacheShape, Runner
from linnet.errors import LinnetError
from linnet.program import build_program
from linnet.rope import rope_tables
from linnet.weight_plan import WeightPlan, plan_weights
from linnet.weights import Weights


def unavailable(mode: str) -> str | None:
    return None  # NumPy is always there


class NumpyRunner(Runner):
    reads_without_logits = True  # NumPy takes a select of no tokens as it comes

    def __init__(self, weights: Weights, cache: CacheShape = CacheShape(), dtype: str = "f32", mode: str = "numpy"):
        if dtype != "f32":
            raise LinnetError(f"reference:numpy runs f32 only, not {dtype}")
        super().__init__(weights.spec, cache)
        start = time.perf_counter()
        self.name = f"reference:{mode}"
        spec = weights.spec
        # no passes but the rings: each op as the Program defines it
        self.program = self._with_rings(build_program(spec, dtype))
        self.weights = plan_weights(weights, WeightPlan.of(self.program))
        positions = cache.positions + 1  # and the scratch position
        shapes = [(cache.rows, spec.num_kv_heads, self.program.cache_slots(kind, cache.positions), spec.head_dim)
                  for kind in self.program.layer_kinds]
        self.cache_k = [np.zeros(shape, np.float32) for shape in shapes]
        self.cache_v = [np.zeros(shape, np.float32) for shape in shapes]
        self.rope_cos, self.rope_sin = rope_tables(spec, positions)
        self.load_time = weights.load_time + time.perf_counter() - start

    def _forward(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, select: np.ndarray | None):
        if select is None:
            select = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
        inputs = {"tokens": tokens, "positions": positions, "rows": rows, "select": select,
                  "rope_cos": self.rope_cos, "rope_sin": self.rope_sin}
        logits, self.cache_k, self.cache_v = run_step(self.program, self.weights, inputs, (self.cache_k, self.cache_v))
        return logits

    def _copy_cache(self, source: int, target: int, length: int) -> None:
        for cache in (*self.cache_k, *self.cache_v):
            span = self.copied_slots(cache.shape[2], length)
            cache[target, :, :span] = cache[source, :, :span]
