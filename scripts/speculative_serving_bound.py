"""How far speculation could take `linnet serve` at several requests in flight, on this machine.

Measures, on the default model with onnx:cpu (the server's backend for it): a decode step of 1 to 4 rows
(each on a runner of that many rows, as a server has a row a request in flight), checks of 1, 2 and 4 rows
of 2-9 positions each, and each copying prompt's read; then the
greedy answers of the copying prompts (128 tokens, the end token ignored, as `linnet bench-serve
--profile cpu-copying` asks) and, after every token, how many of prompt lookup's 8 drafts the answer
keeps. With those it replays 16 requests at 1, 2 and 4 in flight under five rules:

- plain: every busy row decodes a token a step;
- engine: Linnet's rule (`linnet.serve.speculation`): rows speculate while at most 2 are busy, drafts
  shared out, each check costing its rows' own positions (ONNX Runtime's ragged checks);
- engine, padded: the same with the shorter chunks padded to the longest, as before ragged checks;
- by gain: drafts given to the rows whose recent drafts were kept most, at any number of busy rows,
  while their expected tokens a millisecond beat a decode step's (not built);
- oracle: checks holding exactly the drafts that will be kept (no drafter can do better).

A decode step costs what it measured; a check is fitted as a constant plus a cost per position over all
its rows. `--scale` multiplies the part of each past the decode steps' fitted constant (0.5: products twice
as fast) to show what a figure needs.
Run: .venv/bin/python scripts/speculative_serving_bound.py [--threads 2] [--scale 1 0.7 0.5]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from linnet.backends import CacheShape, Runner, create_runner
from linnet.backends.onnx import setup
from linnet.bench.workloads import chat_ids, workload_prompts
from linnet.model import LoadedModel, open_model
from linnet.sampling import Sampling
from linnet.speculative.ngram import PromptLookup

NEW_TOKENS, MOST, REQUESTS = 128, 8, 16


@dataclass
class Trace:
    read_ms: float  # the prompt's read
    offered: list[int]  # after each token, how many drafts prompt lookup proposes (at most MOST)
    kept: list[int]  # ... and how many of them the answer keeps


@dataclass
class Costs:
    decode: dict[int, float]  # ms of a decode step of so many rows, measured on a runner of that many
    fixed: float  # the decode steps' fitted constant: what faster products would not change
    check: tuple[float, float]  # ms = a + b * positions, over all rows

    def step(self, rows: int, positions: int, scale: float) -> float:
        if positions == rows:
            return self.fixed + scale * (self.decode[rows] - self.fixed)
        return self.check[0] + scale * self.check[1] * positions


def median_ms(run: Callable[..., None], *args: int, times: int = 9) -> float:
    run(*args)
    spans = []
    for _ in range(times):
        start = time.perf_counter()
        run(*args)
        spans.append(time.perf_counter() - start)
    return 1000 * float(np.median(spans))


def line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """The least-squares a, b of ms = a + b * x."""
    slope, intercept = np.polyfit([x for x, _ in points], [ms for _, ms in points], 1)
    return float(intercept), float(slope)


def measure_costs(model: LoadedModel, most_rows: int = 4) -> Costs:
    """Decode steps on runners of 1..``most_rows`` rows (a server's rows are its requests in flight), checks
    of 1, 2 and ``most_rows`` rows of 2-9 positions each; every row at 120 tokens."""
    decodes, checks = [], []
    for rows in range(1, most_rows + 1):
        decode_ms, row_checks = runner_costs(model, rows, rows in (1, 2, most_rows))
        decodes.append((rows, decode_ms))
        checks += row_checks
    costs = Costs(dict(decodes), line(decodes)[0], line(checks))
    print("decode steps (rows, ms):", [(r, round(ms, 1)) for r, ms in decodes])
    print("checks (positions, ms):", [(p, round(ms, 1)) for p, ms in checks])
    print(f"fitted: check {costs.check[0]:.1f} + {costs.check[1]:.2f} ms a position; decode's constant "
          f"{costs.fixed:.1f} ms")
    return costs


def runner_costs(model: LoadedModel, rows: int, checks: bool) -> tuple[float, list[tuple[int, float]]]:
    """On a runner of ``rows`` rows at 120 tokens each: a decode step's ms, and (positions, ms) of checks of
    every row's 2, 3, 5 and 9 positions where ``checks``."""
    runner = create_runner("onnx:cpu", model.weights, CacheShape(rows, 512))
    rng = np.random.default_rng(0)
    for row in range(rows):
        runner.prefill(row, rng.integers(100, 40000, 120).tolist())

    def again() -> None:
        for row in range(rows):
            runner.reset(row, 120)

    def decode() -> None:
        runner.decode([5] * rows)
        again()

    def check(width: int) -> None:
        runner.verify({row: [5] * width for row in range(rows)})
        again()

    return median_ms(decode), [(rows * width, median_ms(check, width)) for width in (2, 3, 5, 9) if checks]


def record_traces(runner: Runner, model_tokenizer: object) -> list[Trace]:
    lookup, traces = PromptLookup(), []
    for kind, prompt in workload_prompts("copying"):
        ids = chat_ids(model_tokenizer, prompt)  # type: ignore[arg-type]
        runner.reset(0)
        start = time.perf_counter()
        answer = [int(np.argmax(runner.prefill(0, ids)))]
        read_ms = 1000 * (time.perf_counter() - start)
        while len(answer) < NEW_TOKENS:
            answer.append(int(np.argmax(runner.decode([answer[-1]])[0])))
        offered, kept = [], []
        for t in range(len(answer)):
            drafts = lookup.propose(ids + answer[:t + 1], MOST, Sampling(), np.random.default_rng(0)).tokens
            same = 0
            while same < len(drafts) and t + 1 + same < len(answer) and drafts[same] == answer[t + 1 + same]:
                same += 1
            offered.append(len(drafts))
            kept.append(same)
        traces.append(Trace(read_ms, offered, kept))
        print(f"{kind}: {len(ids)} prompt tokens, read in {read_ms:.0f} ms; {sum(kept)} of {sum(offered)} "
              "drafts offered would be kept")
    return traces


@dataclass
class Row:
    trace: Trace
    at: int = 0  # tokens given so far, less one
    k: int = MOST  # the speculator's k: doubles on a whole kept draft, else falls past the kept ones
    rate: float = 0.6  # its recent share of drafts kept

    def offered(self) -> int:
        return min(self.trace.offered[self.at], NEW_TOKENS - 1 - self.at)


def replay(traces: list[Trace], costs: Costs, rule: str, in_flight: int, scale: float = 1.0) -> float:
    """Tokens a second over REQUESTS requests of the traces in turn, at most ``in_flight`` at a time."""
    waiting = [traces[i % len(traces)] for i in range(REQUESTS)]
    busy: list[Row] = []
    clock = tokens = 0.0
    while waiting or busy:
        while waiting and len(busy) < in_flight:
            busy.append(Row(waiting.pop(0)))
            clock += busy[-1].trace.read_ms
            tokens += 1
        drafts = allot(busy, costs, rule, scale)
        rows = len(busy)
        if rule == "engine, padded" and any(drafts):
            positions = rows * (1 + max(drafts))  # padded to the longest chunk
        else:
            positions = rows + sum(drafts)
        clock += costs.step(rows, positions, scale)
        for row, d in zip(list(busy), drafts):
            kept = min(d, row.trace.kept[row.at])
            if d:
                row.rate = 0.7 * row.rate + 0.3 * kept / d
                row.k = min(MOST, 2 * row.k) if kept == d else kept + 1
            row.at += 1 + kept
            tokens += 1 + kept
            if row.at >= NEW_TOKENS - 1:
                busy.remove(row)
    return 1000 * tokens / clock


def allot(busy: list[Row], costs: Costs, rule: str, scale: float) -> list[int]:
    """Each busy row's drafts this step, under ``rule``."""
    rows = len(busy)
    if rule == "plain" or (rule.startswith("engine") and rows > 2):
        return [0] * rows
    if rule.startswith("engine"):
        each = max(1, (MOST + 1) // rows - 1)
        return [min(row.k, each, row.offered()) for row in busy]
    gains = sorted(((1.0 if i <= row.trace.kept[row.at] else 0.0) if rule == "oracle" else row.rate ** i, n)
                   for n, row in enumerate(busy) for i in range(1, min(row.offered(), MOST) + 1))[::-1]
    best, best_rate, expected = 0, rows / costs.step(rows, rows, scale), float(rows)
    for taken, (gain, _) in enumerate(gains, 1):
        expected += gain
        if expected / costs.step(rows, rows + taken, scale) > best_rate:
            best, best_rate = taken, expected / costs.step(rows, rows + taken, scale)
    drafts = [0] * rows
    for _, n in gains[:best]:
        drafts[n] += 1
    return drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scale", type=float, nargs="+", default=[1.0, 0.7, 0.5])
    args = parser.parse_args()
    setup.set_threads(args.threads)
    model = open_model("smollm2-135m-instruct")
    costs = measure_costs(model)
    traces = record_traces(create_runner("onnx:cpu", model.weights, CacheShape(1, 512)), model.tokenizer)
    for scale in args.scale:
        for in_flight in (1, 2, 4):
            plain = replay(traces, costs, "plain", in_flight, scale)
            ratios = {rule: replay(traces, costs, rule, in_flight, scale) / plain
                      for rule in ("engine", "engine, padded", "by gain", "oracle")}
            print(f"per-position cost x{scale}, {in_flight} in flight: plain {plain:.1f} tok/s; "
                  + ", ".join(f"{rule} {ratio:.2f}x" for rule, ratio in ratios.items()))


if __name__ == "__main__":
    main()
