"""The engine's counters, written by its thread, read by anyone, and rendered as Prometheus text."""
from __future__ import annotations

import threading
import time
from collections import Counter, deque

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATE_WINDOW_S = 10.0  # tokens per second are counted over the last this many seconds


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = time.perf_counter()
        self.requests: Counter[str] = Counter()  # finish reason -> requests ended so far
        self.refused = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.forked_tokens = 0
        self.generated_tokens = 0
        self.steps = 0
        self.drafted_tokens = 0  # speculative decoding: drafts checked, and those kept
        self.accepted_tokens = 0
        self.step_seconds = 0.0
        self.ttft_buckets = [0] * len(TTFT_BUCKETS)
        self.ttft_sum, self.ttft_count = 0.0, 0
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) per step in the rate window

    def step(self, seconds: float, tokens: int, now: float) -> None:
        with self._lock:
            self.steps += 1
            self.step_seconds += seconds
            self.generated_tokens += tokens
            self._recent.append((now, tokens))
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1
            for i, bound in enumerate(TTFT_BUCKETS):
                if seconds <= bound:
                    self.ttft_buckets[i] += 1

    def finished(self, reason: str, prompt_tokens: int, cached_tokens: int = 0, forked_tokens: int = 0) -> None:
        with self._lock:
            self.requests[reason] += 1
            self.prompt_tokens += prompt_tokens
            self.cached_tokens += cached_tokens
            self.forked_tokens += forked_tokens

    def speculated(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self.drafted_tokens += drafted
            self.accepted_tokens += accepted

    def refuse(self) -> None:
        with self._lock:
            self.refused += 1

    def tokens_per_second(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        with self._lock:
            tokens = sum(n for t, n in self._recent if t >= now - RATE_WINDOW_S)
        return tokens / max(min(RATE_WINDOW_S, now - self.started), 1e-9)

    def prometheus(self, queue_length: int, rows_busy: int, rows: int) -> str:
        """The Prometheus text format (version 0.0.4)."""
        rate = self.tokens_per_second()
        with self._lock:
            lines = [
                *_metric("linnet_queue_length", "gauge", "requests waiting for a free cache row", queue_length),
                *_metric("linnet_rows_busy", "gauge", "cache rows holding a request", rows_busy),
                *_metric("linnet_rows", "gauge", "cache rows in all", rows),
                *_metric("linnet_generation_tokens_per_second", "gauge",
                         f"tokens sampled per second over the last {RATE_WINDOW_S:g} s", rate),
                *_metric("linnet_generation_tokens_total", "counter", "tokens sampled", self.generated_tokens),
                *_metric("linnet_prompt_tokens_total", "counter", "prompt tokens read", self.prompt_tokens),
                *_metric("linnet_prompt_tokens_cached_total", "counter",
                         "prompt tokens a row held already (prefix caching), not read again", self.cached_tokens),
                *_metric("linnet_prompt_tokens_forked_total", "counter",
                         "prompt tokens a row copied from another choice's row (n > 1), not read again",
                         self.forked_tokens),
                *_metric("linnet_speculative_draft_tokens_total", "counter",
                         "drafted tokens checked (speculative decoding)", self.drafted_tokens),
                *_metric("linnet_speculative_accepted_tokens_total", "counter",
                         "drafted tokens kept (speculative decoding)", self.accepted_tokens),
                *_metric("linnet_steps_total", "counter", "batched model steps", self.steps),
                *_metric("linnet_step_seconds_total", "counter", "time spent in model steps", self.step_seconds),
                *_metric("linnet_requests_refused_total", "counter", "requests refused: the queue was full",
                         self.refused),
                "# HELP linnet_requests_total requests ended, by finish reason",
                "# TYPE linnet_requests_total counter",
                *(f'linnet_requests_total{{finish_reason="{reason}"}} {n}'
                  for reason, n in sorted(self.requests.items())),
                "# HELP linnet_time_to_first_token_seconds from a request's arrival to its first token",
                "# TYPE linnet_time_to_first_token_seconds histogram",
                *(f'linnet_time_to_first_token_seconds_bucket{{le="{bound:g}"}} {n}'
                  for bound, n in zip(TTFT_BUCKETS, self.ttft_buckets)),
                f'linnet_time_to_first_token_seconds_bucket{{le="+Inf"}} {self.ttft_count}',
                f"linnet_time_to_first_token_seconds_sum {self.ttft_sum:.6f}",
                f"linnet_time_to_first_token_seconds_count {self.ttft_count}",
            ]
        return "\n".join(lines) + "\n"


def _metric(name: str, kind: str, help_text: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
