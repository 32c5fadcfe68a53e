"""The machine's matrix-product rate, measured in the run, and each serving row's arithmetic against it.

Batch-1 decode is bound by the bytes it reads (``linnet.bench.bandwidth``); a server's step of many rows
multiplies each weight it reads by every row, so there the bound is arithmetic. The bench measures the
rate itself, in a process started as the servers are (same threads, same OpenMP settings): torch's
matrix product of two square matrices in the run's dtype, large enough to run at the kernels' best.
Each serving row is then reported as its matrix-product FLOPs per token x output tokens per second, and
as a share of that rate.

FLOPs per token are the model's matrix products, counted alike for every server: two per weight of
q/k/v, o, gate/up, down and the output head. Attention over the cache, norms and the prompt's tokens
are left out: at these lengths they are a few percent, and a server that spends more on them has that
cost in its throughput, not in its count.
"""
from __future__ import annotations

import json
import re
import sys
import time
from typing import Any

from linnet.bench.machine import run_measurement
from linnet.dtypes import DTYPES
from linnet.results import Machine, Row
from linnet.spec import ModelSpec

SIZE = 2048  # 17 GFLOP a product: a second or more on two cores, far past any per-call overhead
PASSES = 5


def measure(dtype: str = "f32", size: int = SIZE, passes: int = PASSES) -> list[float]:
    """GFLOP/s of each timed ``[size, size] @ [size, size]`` in ``dtype``, after one untimed product."""
    import torch

    a, b = (torch.randn(size, size).to(getattr(torch, DTYPES[dtype].hf)) for _ in range(2))
    a @ b
    samples = []
    for _ in range(passes):
        start = time.perf_counter()
        a @ b
        samples.append(2 * size**3 / (time.perf_counter() - start) / 1e9)
    return samples


def measure_apart(env: dict[str, str], dtype: str, log: Any = sys.stderr, size: int = SIZE,
                  passes: int = PASSES) -> list[float]:
    """``measure`` in a process of its own with ``env``, as the servers run."""
    return run_measurement("linnet.bench.arithmetic", [dtype, str(size), str(passes)], env,
                              f"{dtype} matrix-product rate", log)


def flops_per_token(spec: ModelSpec) -> int:
    """Two per weight of every matrix a token is multiplied by (the head included)."""
    h = spec.hidden_size
    layer = h * (spec.q_size + 2 * spec.kv_size) + spec.q_size * h + 3 * h * spec.intermediate_size
    return 2 * (spec.num_layers * layer + spec.vocab_size * h)


def note(spec: ModelSpec, tok_s: float, gflop_s: float, dtype: str) -> str:
    rate = flops_per_token(spec) * tok_s / 1e9
    return (f"matrix products: {flops_per_token(spec) / 1e9:.3f} GFLOP per token: {rate:.1f} GFLOP/s, "
            f"{rate / gflop_s:.0%} of the {dtype} matrix-product rate measured in this run")


def add_notes(rows: list[Row], spec: ModelSpec, gflop_s: float, dtype: str) -> None:
    """Each serving row's matrix-product rate, and its share of ``gflop_s``, in its notes."""
    for row in rows:
        if row.not_run is None and "serve_tok_s" in row.metrics:
            row.notes.append(note(spec, row.measured("serve_tok_s"), gflop_s, dtype))


_NOTE = re.compile(r"^matrix products: [0-9.]+ GFLOP per token: ([0-9.]+) GFLOP/s, ([0-9]+)%")


def share(row: Row) -> str:
    """A serving row's share of the measured matrix-product rate, from its note; "–" without one."""
    found = next((m for n in row.notes if (m := _NOTE.match(n))), None)
    return "–" if found is None else f"{found[2]}%"


def measured(machine: Machine) -> str:
    """The measured matrix-product rate, for a summary's machine line; "" where none was measured."""
    m = machine.matmul_gflop_s
    return "" if m is None else f" · matrix products {m.value:.0f} GFLOP/s"


if __name__ == "__main__":
    dtype, size, passes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(measure(dtype, size, passes)))
