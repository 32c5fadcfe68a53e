"""The Runner contract: the seam that generation, serving and benchmarks stand on.

A runner owns weights and a KV cache of ``rows x positions``. Its one batched call is ``step``: any mix
of prefill chunks ``(row, tokens, start)`` and one-token decode rows ``(row, token)``, with sampling per
row, returning a token id per row, sampled where the model runs (logits only on request). A row whose
tokens would not fit its cache, or name ids outside the vocabulary, gets that status and the others
proceed. ``prefill``, ``decode`` and ``generate`` are thin wrappers for one request.

Backends implement the array hooks (``_forward`` and, where arrays are not NumPy's, ``_stack``,
``_to_host``, ``_sample``, ``_new_rng``). Shapes stay few: a decode call runs the rows it advances
padded to one of ``decode_sizes()`` (padding rows write a scratch position past the last real one,
which no real query reads), and prefill runs in chunks of at most ``prefill_chunk`` tokens, so compiled
backends compile a handful of shapes, once each (``warm_up`` compiles them all).
Position ``p`` of a row is always written before any query reads it, so ``reset`` needs no clearing.
``copy_row`` gives a row another's cache (``Prefill.forks`` does so inside a step: ``n`` choices of one
prompt read it once, then each draws its own first token from the same logits).
Sliding layers keep rings of their window and the prefill chunk (``linnet.program.rings``), sized when
the runner is made: ``prefill_chunk`` may shrink later, never grow past that.
"""
from __future__ import annotations

import resource
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from linnet.errors import CacheFull, LinnetError, TokenError
from linnet.program import Program
from linnet.program.rings import ring_caches, rings
from linnet.sampling import Sampling, sample_host
from linnet.spec import ModelSpec

# NO_TOKENS: a control's ``adjust`` left no token to draw (every logit -inf, or a NaN)
OK, CACHE_FULL, BAD_TOKENS, NO_TOKENS = "ok", "cache_full", "bad_tokens", "no_tokens"
HOST_STREAM = 0x6C6E  # mixed into a seed for host draws (``Runner._host_sampler``)
GREEDY = Sampling()


def cache_positions(tokens: int, multiple: int = 128) -> int:
    """A KV-cache length that holds ``tokens``, rounded up to ``multiple``."""
    return -(-tokens // multiple) * multiple


@dataclass(frozen=True)
class CacheShape:
    rows: int = 1
    positions: int = 768
    # the most tokens of a row one model call writes (the runner's prefill_chunk; None: the backend's
    # own), which sizes sliding layers' ring caches (window + chunk - 1 positions)
    chunk: int | None = None


@dataclass(frozen=True)
class Prefill:
    """Write ``tokens`` at ``start..`` of ``row``; then draw the next token, unless ``sample`` is False
    (a chunk of a prompt that goes on in a later step)."""

    row: int
    tokens: Sequence[int]
    start: int = 0
    sample: bool = True
    # report each token's logprob under the logits before it and this many top alternatives (0..20): the
    # chunk is read alone with every position's logits on the host, and its drawn token is drawn there
    prompt_logprobs: int | None = None
    # rows that take this row's cache once the chunk is read (``Runner.copy_row``) and draw their own first
    # token from its logits, each with its own sampling and control: one prompt read for several choices
    forks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Decode:
    """Write ``token`` at the row's next position and draw the next token."""

    row: int
    token: int


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class Control:
    """Per-row work on one step's logits, on the host, before the row's token is drawn."""

    # edits the row's f32 logits [vocab] in place (grammar masks to -inf, penalties, logit_bias)
    adjust: Callable[[np.ndarray], None] | None = None
    # report the drawn token's log-probability and this many top alternatives (0..MAX_TOP_LOGPROBS)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise LinnetError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")


@dataclass
class RowResult:
    row: int
    status: str = OK  # OK, CACHE_FULL or BAD_TOKENS (then ``message`` says why and nothing was written)
    token: int | None = None
    logits: np.ndarray | None = None  # [vocab] float32, when the step was asked for logits
    message: str = ""
    # with a Control asking for logprobs: the drawn token's log-probability under the model's own
    # distribution (log-softmax of its logits, before ``adjust``), and the most likely tokens, best first
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    # with ``Prefill.prompt_logprobs``: (token, its logprob, the top alternatives) of each token of the chunk
    # after the prompt's first, which has no logits before it
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-softmax of one row of logits, computed in float64."""
    scores = logits.astype(np.float64)
    shifted = scores - scores.max()
    return shifted - np.log(np.exp(shifted).sum())


def top_logprobs(logprobs: np.ndarray, count: int) -> list[tuple[int, float]]:
    """The ``count`` most likely tokens and their log-probabilities, best first (ties: lower id first)."""
    if count <= 0:
        return []
    count = min(count, logprobs.size)
    best = np.argpartition(-logprobs, count - 1)[:count]
    best = best[np.lexsort((best, -logprobs[best]))]
    return [(int(t), float(logprobs[t])) for t in best]


# A model call's own cost in padded prompt tokens, beside the tokens it reads: SmolLM2 on ONNX Runtime's CPU
# provider (2 threads) read groups of 128-248 padded tokens in 24 ms a call plus 0.68 ms a token; splitting
# short prompts to pad less at that price read the decode-heavy profile's waves 1.0-1.4% faster than
# filling each call shortest first (docs/NOTEBOOK.md, 2026-12-03 23:32).
CALL_TOKENS = 32


def groups_by_length(lengths: Sequence[int], most: int, call_tokens: int = CALL_TOKENS) -> list[tuple[int, int]]:
    """Split ascending ``lengths`` into runs read a call each, as [begin, end) bounds: the split of least
    cost, a run costing its padded tokens (its size x its last, longest length) and ``call_tokens``, and
    padding to at most ``most`` tokens unless it is a single length."""
    cost, begins = [0.0], []
    for end in range(1, len(lengths) + 1):
        options = [(cost[begin] + call_tokens + (end - begin) * lengths[end - 1], begin)
                   for begin in range(end - 1, -1, -1)
                   if begin == end - 1 or (end - begin) * lengths[end - 1] <= most]
        best, begin = min(options)
        cost.append(best)
        begins.append(begin)
    bounds, end = [], len(lengths)
    while end:
        bounds.append((begins[end - 1], end))
        end = begins[end - 1]
    return bounds[::-1]


def _ring_lost(slots: int, window: int, held: int, start: int) -> bool:
    """Whether a ring of ``slots`` for a ``window``, in a row that has written ``held`` positions in order,
    has lost a key that the queries of a prefill at ``start`` read: position p stays until p + slots is
    written, and the queries read back to ``start - window + 1`` (never so at 0: that prefill writes every
    key its queries read)."""
    return start > 0 and held > max(0, start - window + 1) + slots


class Runner(ABC):
    name: str = "runner"
    prefill_chunk: int = 256  # the most tokens of one row a single model call takes
    prompts_together: bool = False  # whether one call may read several rows' short prompts (``prompt_groups``)
    # whether ``_forward`` takes a ``select`` of no tokens: a prompt chunk whose logits nobody reads then
    # skips the head's product (a pass over the vocabulary's weights: 11-25 ms a call on Qwen2.5-0.5B's
    # shapes on ONNX Runtime, 2 threads; docs/NOTEBOOK.md, 2026-12-03 20:00). Compiled backends would
    # build another shape for it, so they keep the last token's.
    reads_without_logits: bool = False
    # Set by ``_with_rings``: (slots, window) of each ring cache, the prefill chunk they were sized for
    # (None: no rings), and the bytes of keys and values a cache row holds.
    rings: frozenset[tuple[int, int]] = frozenset()
    ring_chunk: int | None = None
    cache_bytes_per_row: int = 0
    cache_dtype: str = "f32"  # the KV cache's (``kept_cache_dtype``)

    def __init__(self, spec: ModelSpec, cache: CacheShape):
        if cache.rows < 1 or cache.positions < 2 or (cache.chunk is not None and cache.chunk < 1):
            raise LinnetError(f"cache must have at least 1 row, 2 positions and a chunk of 1, got {cache}")
        self.spec = spec
        self.cache = cache
        if cache.chunk is not None:
            self.prefill_chunk = cache.chunk
        self.lengths = [0] * cache.rows  # tokens held by each row
        self.load_time = 0.0
        self._samplers: dict[int, tuple[Sampling, Any]] = {}  # row -> its sampling and random state
        # the same for host draws (``_draw_picks``: rows whose logits a Control adjusts)
        self._host_samplers: dict[int, tuple[Sampling, np.random.Generator]] = {}
        self._prompt_tail: dict[int, np.ndarray] = {}  # row -> its last prompt chunk's last logits (``_read_scored``)

    # -- the contract -------------------------------------------------------------------------
    def step(
        self,
        prefill: Sequence[Prefill] = (),
        decode: Sequence[Decode] = (),
        sampling: Mapping[int, Sampling] | None = None,
        logits: bool = False,
        controls: Mapping[int, Control] | None = None,
    ) -> dict[int, RowResult]:
        """One batched step; a result per row named. Rows without a ``sampling`` entry are greedy. Rows with
        a ``Control`` whose ``adjust`` is set draw on the host from their adjusted logits (``_draw_picks``); the
        others draw where the model runs, as without controls."""
        sampling = sampling or {}
        controls = controls or {}
        entries: list[Prefill | Decode] = [*prefill, *decode]
        forks = {f: p for p in prefill for f in p.forks}
        rows = [e.row for e in entries] + [f for p in prefill for f in p.forks]
        for row in rows:
            self._check_row(row)
        if len(set(rows)) != len(rows):
            raise LinnetError(f"a row may appear once per step, got rows {rows}")
        if any(p.forks and not p.sample for p in prefill):
            raise LinnetError("only a prompt's last chunk, which draws a token, can be forked")
        results: dict[int, RowResult] = {}
        ready_prefill: list[Prefill] = []
        ready_decode: list[Decode] = []
        for entry in entries:
            try:
                if isinstance(entry, Prefill):
                    self._check_prefill(entry.row, entry.tokens, entry.start)
                    ready_prefill.append(entry)
                else:
                    self._check_fits(self.lengths[entry.row] + 1)
                    self._check_tokens([entry.token])
                    ready_decode.append(entry)
                results[entry.row] = RowResult(entry.row)
            except (CacheFull, TokenError) as e:
                status = CACHE_FULL if isinstance(e, CacheFull) else BAD_TOKENS
                results[entry.row] = RowResult(entry.row, status, message=str(e))
        for fork, p in forks.items():  # a fork fares as the chunk it copies
            results[fork] = RowResult(fork, results[p.row].status, message=results[p.row].message)

        picks: list[tuple[int, Any, int]] = []  # (row, logits array [R, 1, vocab], its index in R)
        on_host: dict[int, np.ndarray] = {}  # row -> the logits [vocab] it draws from, already on the host
        for group in self.prompt_groups(ready_prefill):
            for p in group:
                if p.start == 0:  # a new request: fresh random streams
                    self._samplers.pop(p.row, None)
                    self._host_samplers.pop(p.row, None)
                    self._prompt_tail.pop(p.row, None)
            if group[0].prompt_logprobs is not None:  # alone (``prompt_groups``)
                p = group[0]
                read = self._read_scored(p, results[p.row])
                self.lengths[p.row] = p.start + len(p.tokens)
                if p.sample:
                    on_host[p.row] = read
                for fork in p.forks:  # each its own copy: a control's ``adjust`` writes in place
                    self.copy_row(p.row, fork, self.lengths[p.row])
                    on_host[fork] = read.copy()
                    results[fork].prompt_logprobs = list(results[p.row].prompt_logprobs)
                continue
            if len(group) == 1:
                p = group[0]
                outs = [(p, self._prefill_row(p.row, list(p.tokens), p.start, all_logits=False, pick=p.sample), 0)]
            else:
                out = self._prefill_prompts(group)
                outs = [(p, out, i) for i, p in enumerate(group)]
            for p, out, index in outs:
                self.lengths[p.row] = p.start + len(p.tokens)
                if p.sample:
                    picks.append((p.row, out, index))
                for fork in p.forks:  # drawn from the same logits, with the fork's own sampler
                    self.copy_row(p.row, fork, self.lengths[p.row])
                    picks.append((fork, out, index))
        if ready_decode:
            out, indices = self._decode_rows({d.row: d.token for d in ready_decode})
            picks += [(d.row, out, indices[d.row]) for d in ready_decode]
        if picks or on_host:
            self._draw_picks(picks, sampling, controls, logits, results, on_host)
        return results

    def _read_scored(self, p: Prefill, result: RowResult) -> np.ndarray:
        """Read a prompt chunk with every position's logits on the host, reporting each token's logprob under
        the logits before it (the chunk's first token's: the previous chunk's last, kept for it); the last
        position's logits."""
        assert p.prompt_logprobs is not None
        every = self._prefill_row(p.row, list(p.tokens), p.start, all_logits=True)  # [T, vocab] host f32
        before = self._prompt_tail.pop(p.row, None)
        scored = [(before, p.tokens[0])] if before is not None else []
        scored += [(every[i], p.tokens[i + 1]) for i in range(len(p.tokens) - 1)]
        for row_logits, token in scored:
            logprobs = log_softmax(row_logits)
            result.prompt_logprobs.append((int(token), float(logprobs[token]),
                                           top_logprobs(logprobs, p.prompt_logprobs)))
        if not p.sample:
            self._prompt_tail[p.row] = every[-1]
        return np.array(every[-1], dtype=np.float32)

    def _draw_picks(self, picks: list[tuple[int, Any, int]], sampling: Mapping[int, Sampling],
                    controls: Mapping[int, Control], logits: bool, results: dict[int, RowResult],
                    read_on_host: Mapping[int, np.ndarray]) -> None:
        """Each picked row's token into ``results``. Rows whose control adjusts their logits bring them to the
        host and draw there (greedy: the adjusted argmax), as do rows whose logits are there already
        (``read_on_host``); the rest draw where the model runs, in one call, and only rows that report logits
        or logprobs copy theirs to the host. A row that only asks for logprobs so draws the same tokens as
        without them."""
        on_host = {row for row, control in controls.items() if control.adjust is not None}
        adjusted = [p for p in picks if p[0] in on_host]
        on_device = [p for p in picks if p[0] not in on_host]
        if on_device:
            stacked = self._stack([(array, index) for _, array, index in on_device])
            states = [self._sampler(row, sampling.get(row, GREEDY)) for row, _, _ in on_device]
            tokens = self._sample(stacked, states)
            for (row, _, _), token in zip(on_device, tokens):
                results[row].token = int(token)
            wanted = [p for p in on_device if logits or self._wants_logprobs(controls.get(p[0]))]
            if wanted:
                host = self._to_host(self._stack([(array, index) for _, array, index in wanted]))
                for (row, _, _), row_logits in zip(wanted, host):
                    self._report(results[row], row_logits, controls.get(row), logits)
        host_rows: list[tuple[int, np.ndarray]] = list(read_on_host.items())
        if adjusted:
            # a copy: a backend's host view may be the step's own buffer, and ``adjust`` writes in place
            host = np.array(self._to_host(self._stack([(array, index) for _, array, index in adjusted])),
                            dtype=np.float32)
            host_rows += [(row, row_logits) for (row, _, _), row_logits in zip(adjusted, host)]
        for row, row_logits in host_rows:
            control = controls.get(row)
            raw = row_logits.copy() if logits or self._wants_logprobs(control) else None
            if control is not None and control.adjust is not None:
                control.adjust(row_logits)
            if not np.isfinite(row_logits).any() or np.isnan(row_logits).any():
                results[row].status = NO_TOKENS
                results[row].message = "no token is left to draw: every one was masked out"
                continue
            state = self._host_sampler(row, sampling.get(row, GREEDY))
            results[row].token = sample_host(row_logits, *state)
            if raw is not None:
                self._report(results[row], raw, control, logits)

    @staticmethod
    def _wants_logprobs(control: Control | None) -> bool:
        return control is not None and control.logprobs is not None

    @staticmethod
    def _report(result: RowResult, raw: np.ndarray, control: Control | None, logits: bool) -> None:
        """The row's logits (when asked) and its drawn token's logprobs (when its control asks), both from the
        model's logits before any ``adjust``: OpenAI's and vLLM's (its default ``raw_logprobs``) meaning."""
        if logits:
            result.logits = raw
        if control is not None and control.logprobs is not None and result.token is not None:
            logprobs = log_softmax(raw)
            result.logprob = float(logprobs[result.token])
            result.top_logprobs = top_logprobs(logprobs, control.logprobs)

    def prefill(self, row: int, tokens: Sequence[int], start: int = 0, all_logits: bool = False) -> np.ndarray:
        """Write ``tokens`` at ``start..`` of ``row``; logits of the last position (or of every one)."""
        self._check_row(row)
        self._check_prefill(row, tokens, start)
        out = self._prefill_row(row, list(tokens), start, all_logits)
        self.lengths[row] = start + len(tokens)
        return out if all_logits else self._to_host(out)[0, 0]

    def verify(self, chunks: Mapping[int, Sequence[int]]) -> dict[int, np.ndarray]:
        """Each row's ``chunk`` read at the row's length, and every position's logits [len(chunk), vocab] (host
        f32): speculative decoding's check of a row's last token and its drafts. The rows go in one call,
        the shorter chunks padded to the longest with positions past their own, which the row writes again
        before any query reads them. The rows' lengths stay: the caller counts the positions it keeps
        (``Speculator.settle``)."""
        if not chunks:
            return {}
        self._check_verify(chunks)
        width = max(len(chunk) for chunk in chunks.values())
        together = [row for row in sorted(chunks) if self.lengths[row] + width <= self.cache.positions]
        out: dict[int, np.ndarray] = {}
        if len(together) > 1:
            tokens = np.zeros((len(together), width), dtype=np.int64)
            for i, row in enumerate(together):
                tokens[i, :len(chunks[row])] = chunks[row]
            positions = np.array([self.lengths[row] for row in together], dtype=np.int64)[:, None] + np.arange(width)
            logits = self._to_host(self._forward(tokens, positions, np.array(together, dtype=np.int64), None))
            out = {row: logits[i, :len(chunks[row])] for i, row in enumerate(together)}
        for row, chunk in chunks.items():
            if row not in out:
                out[row] = self._prefill_row(row, list(chunk), self.lengths[row], all_logits=True)
        return out

    def _check_verify(self, chunks: Mapping[int, Sequence[int]]) -> None:
        for row, chunk in chunks.items():
            self._check_row(row)
            if not 1 <= len(chunk) <= self.prefill_chunk:
                raise LinnetError(f"a chunk to verify holds 1 to {self.prefill_chunk} tokens (the prefill chunk), "
                                  f"got {len(chunk)} for row {row}")
            self._check_fits(self.lengths[row] + len(chunk))
            self._check_tokens(chunk)
        self._check_chunk()

    def decode(self, tokens: Sequence[int], active: Sequence[bool] | None = None) -> np.ndarray:
        """One token for every row (inactive rows' tokens are ignored); logits ``[rows, vocab]``."""
        if len(tokens) != self.cache.rows:
            raise LinnetError(f"decode takes one token per cache row ({self.cache.rows}), got {len(tokens)}")
        active = [True] * self.cache.rows if active is None else list(active)
        rows = {row: token for row, (token, on) in enumerate(zip(tokens, active)) if on}
        for row in rows:
            self._check_fits(self.lengths[row] + 1)
        self._check_tokens(list(rows.values()))
        out, index = self._decode_rows(rows)
        host = self._to_host(out)[:, 0]
        logits = np.zeros((self.cache.rows, host.shape[-1]), dtype=np.float32)
        for row, i in index.items():
            logits[row] = host[i]
        return logits

    def warm_up(self, verify: tuple[int, int] | None = None) -> float:
        """Run a prompt chunk and a decode step once on the scratch position (no row's tokens are touched),
        so that compiling, or loading compiled code, happens now rather than in a request's first
        token; the seconds it took. ``verify`` (rows, tokens): speculative decoding's checks too, every
        shape that ``verify`` takes for up to that many rows of up to that many tokens each."""
        start = time.perf_counter()
        scratch = np.full((1, 2), self.scratch_position, dtype=np.int64)
        self._forward(np.zeros((1, 2), dtype=np.int64), scratch, np.zeros(1, dtype=np.int64),
                      np.array([[1]], dtype=np.int64))
        for size in self.warmed_decode_sizes():
            self._forward(np.zeros((size, 1), dtype=np.int64),
                          np.full((size, 1), self.scratch_position, dtype=np.int64),
                          np.arange(size, dtype=np.int64), None)
        for rows, width in self.verify_shapes(*verify) if verify else ():
            self._forward(np.zeros((rows, width), dtype=np.int64),
                          np.full((rows, width), self.scratch_position, dtype=np.int64),
                          np.arange(rows, dtype=np.int64), None)
        return time.perf_counter() - start

    def verify_shapes(self, rows: int, tokens: int) -> list[tuple[int, int]]:
        """The (rows, length) calls that stand for every shape ``verify`` takes with up to ``rows`` rows
        (in one call) of 2 to ``tokens`` tokens each (a row's last token and at least one draft)."""
        counts = range(1, min(rows, self.cache.rows) + 1)
        return [(n, width) for n in counts for width in self.all_logits_lengths(min(tokens, self.prefill_chunk))]

    def all_logits_lengths(self, tokens: int) -> tuple[int, ...]:
        """The lengths that chunks of 2 to ``tokens`` tokens, every position's logits read, take as shapes:
        one, where the backend compiles nothing or a length that varies (``XlaRunner`` pads to a few)."""
        return (2,)

    def reset(self, row: int, keep: int = 0) -> None:
        """Free ``row`` for a new request, keeping its first ``keep`` positions (a prefix the new request
        shares with what the row held; ``can_keep`` says where that is possible)."""
        self._check_row(row)
        if not self.can_keep(row, keep):
            raise LinnetError(f"row {row} holds {self.lengths[row]} positions and cannot keep its first {keep}: "
                              "its sliding layers' ring caches no longer hold them")
        self.lengths[row] = keep
        self._samplers.pop(row, None)
        self._host_samplers.pop(row, None)
        self._prompt_tail.pop(row, None)

    def copy_row(self, source: int, target: int, length: int) -> None:
        """Give ``target`` the first ``length`` positions of ``source``'s cache, every layer's keys and values
        (a sliding layer's ring whole, as it is), as if it had read them itself; its random streams start
        afresh. ``n`` > 1 reads a prompt once and forks its rows so. ``source`` must still hold those positions
        (``can_keep``)."""
        self._check_row(source)
        self._check_row(target)
        if source == target:
            raise LinnetError(f"copy_row needs two rows, got row {source} twice")
        if length < 1 or not self.can_keep(source, length):
            raise LinnetError(f"row {source} holds {self.lengths[source]} positions and cannot give its first {length}"
                              + (": its sliding layers' ring caches no longer hold them"
                                 if 1 <= length <= self.lengths[source] else ""))
        self._copy_cache(source, target, length)
        self.reset(target)
        self.lengths[target] = length

    def copied_slots(self, slots: int, length: int) -> int:
        """How many of a layer's cache slots ``copy_row`` copies for ``length`` positions: that many where the
        layer holds every position (its slots outnumber the cache's positions: they add the scratch one);
        every slot of a ring, which keeps position p at slot p mod N."""
        return length if slots > self.cache.positions else slots

    def can_keep(self, row: int, keep: int) -> bool:
        """Whether ``row`` can keep its first ``keep`` positions, its next prompt read from there. A ring of N
        slots keeps position p until position p + N is written; the queries from ``keep`` on read back to
        ``keep - W + 1``, which the row's earlier writes (up to what it holds) must not have overwritten."""
        held = self.lengths[row]
        return keep == 0 or (keep <= held and not any(_ring_lost(slots, window, held, keep)
                                                       for slots, window in self.rings))

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "rows": self.cache.rows, "positions": self.cache.positions,
                "kv_cache_bytes_per_row": self.cache_bytes_per_row, "kv_cache_dtype": self.cache_dtype}

    def peak_memory(self) -> int:
        """Peak resident memory of this process in bytes (backends on a GPU report the device's)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    # -- backends ------------------------------------------------------------------------------
    @abstractmethod
    def _forward(self, tokens: np.ndarray, positions: np.ndarray, rows: np.ndarray, select: np.ndarray | None) -> Any:
        """The Program's step (``linnet.program``) on int64 ``tokens``/``positions`` [R, T], ``rows`` [R],
        ``select`` [R, S] (None: every token). Updates the cache; returns the logits [R, S, vocab] f32 as
        the backend's array, on its device."""

    @abstractmethod
    def _copy_cache(self, source: int, target: int, length: int) -> None:
        """Copy each layer's keys and values of row ``source`` into row ``target``: the first
        ``copied_slots(slots, length)`` slots, in place (a compiled step or a bound buffer keeps the cache)."""

    def _stack(self, picks: list[tuple[Any, int]]) -> Any:
        """[N, vocab]: row ``index``, selected token 0, of each logits array."""
        return np.stack([np.asarray(array)[index, 0] for array, index in picks])

    def _to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array, dtype=np.float32)

    def _new_rng(self, seed: int | None) -> Any:
        return np.random.default_rng(seed)

    def _sample(self, logits: Any, samplers: list[tuple[Sampling, Any]]) -> list[int]:
        """A token id per row of ``logits`` [N, vocab]; only the ids need leave the device. This default
        is for host arrays (NumPy); device backends draw on the device."""
        return [sample_host(row, sampling, rng) for row, (sampling, rng) in zip(np.asarray(logits), samplers)]

    # -- the wrappers' common parts --------------------------------------------------------------
    @property
    def scratch_position(self) -> int:
        """Where idle rows write: one position past the last real one (backends allocate positions + 1)."""
        return self.cache.positions

    def _with_rings(self, program: Program, scratch: int | None = None) -> Program:
        """``program`` with its sliding layers' caches as rings of their window and ``prefill_chunk``
        where those hold fewer than the cache's positions (``linnet.program.rings``); ``scratch``: the
        scratch position, where it is not yet ``scratch_position``. Every backend's program passes here."""
        program = ring_caches(program, self.cache.positions, self.prefill_chunk,
                              self.scratch_position if scratch is None else scratch)
        self.rings = rings(program)
        self.ring_chunk = self.prefill_chunk if self.rings else None
        self.cache_dtype = self.kept_cache_dtype(program)
        self.cache_bytes_per_row = program.cache_bytes_per_row(self.cache.positions, self.cache_dtype)
        return program

    def kept_cache_dtype(self, program: Program) -> str:
        """The dtype this backend keeps ``program``'s KV cache in: the program's (a backend computing in a
        wider dtype than the program's may keep it so)."""
        return program.cache_dtype

    def _prefill_row(self, row: int, tokens: list[int], start: int, all_logits: bool, pick: bool = True) -> Any:
        """Chunks of at most ``prefill_chunk`` tokens; the last chunk's logits (all, on the host, if asked;
        none where ``pick`` is False and the backend ``reads_without_logits``)."""
        self._check_chunk()
        every, out = [], None
        for at in range(0, len(tokens), self.prefill_chunk):
            chunk = tokens[at:at + self.prefill_chunk]
            # reshaped, not [None]: a stride of 0 on the row axis would be a new shape to a compiler
            positions = np.arange(start + at, start + at + len(chunk), dtype=np.int64).reshape(1, -1)
            read = pick and at + self.prefill_chunk >= len(tokens)  # the logits someone reads
            if all_logits:
                select = None
            elif read or not self.reads_without_logits:
                select = np.array([[len(chunk) - 1]], dtype=np.int64)
            else:
                select = np.zeros((1, 0), dtype=np.int64)
            out = self._forward(np.array([chunk], dtype=np.int64), positions, np.array([row], dtype=np.int64), select)
            if all_logits:
                every.append(self._to_host(out)[0])
        return np.concatenate(every) if all_logits else out

    def prompt_groups(self, prefill: Sequence[Prefill]) -> list[list[Prefill]]:
        """How a step reads its prompt chunks, one model call per group. Alone, unless the backend reads
        several rows' prompts in one call (``prompts_together``): then the chunks that begin a prompt and
        are shorter than ``prefill_chunk`` go together by length, each group padded to its longest and to
        at most ``prefill_chunk`` tokens, split where padding and calls cost least (``groups_by_length``).
        A short prompt alone leaves the products too few rows to run well (16 prompts of 40 tokens,
        SmolLM2 on ONNX Runtime, 2 threads: 1.73 ms a token one at a time, 1.07-1.27 three to eight at a
        time; docs/SERVE.md). The calls keep the order of the chunks (a group where its first is), so the
        longest-waiting prompt is not read last; grouping a group again gives it back whole."""
        if not self.prompts_together:
            return [[p] for p in prefill]
        place = {id(p): i for i, p in enumerate(prefill)}
        short = sorted((p for p in prefill if p.start == 0 and len(p.tokens) < self.prefill_chunk
                        and p.prompt_logprobs is None),
                       key=lambda p: len(p.tokens))
        bounds = groups_by_length([len(p.tokens) for p in short], self.prefill_chunk)
        groups = [short[begin:end] for begin, end in bounds]
        grouped = {id(p) for p in short}
        groups += [[p] for p in prefill if id(p) not in grouped]
        return sorted(groups, key=lambda group: min(place[id(p)] for p in group))

    def _prefill_prompts(self, group: Sequence[Prefill]) -> Any:
        """Several rows' first prompt chunks in one call, each padded to the longest with token 0. A pad
        writes its row's positions past the prompt, which the row's next tokens write again before any
        query reads them. The logits [R, 1, vocab] of each row's last real token, in the group's order."""
        self._check_chunk()
        width = max(len(p.tokens) for p in group)
        tokens = np.zeros((len(group), width), dtype=np.int64)
        for i, p in enumerate(group):
            tokens[i, :len(p.tokens)] = p.tokens
        positions = np.tile(np.arange(width, dtype=np.int64), (len(group), 1))
        rows = np.array([p.row for p in group], dtype=np.int64)
        select = np.array([[len(p.tokens) - 1] for p in group], dtype=np.int64)
        return self._forward(tokens, positions, rows, select)

    def decode_sizes(self) -> tuple[int, ...]:
        """The batch sizes a decode step runs at; the rows it advances are padded with idle rows (writing
        the scratch position) up to the next. Powers of 4 up to the cache's rows: a step of a few
        requests does the work of a few rows, and a compiler builds a handful of shapes, once each."""
        sizes, n = [], 1
        while n < self.cache.rows:
            sizes.append(n)
            n *= 4
        return (*sizes, self.cache.rows)

    def warmed_decode_sizes(self) -> tuple[int, ...]:
        """The decode sizes the warm-up runs: every one, where each is a compile of its own."""
        return self.decode_sizes()

    def _decode_rows(self, tokens_by_row: dict[int, int]) -> tuple[Any, dict[int, int]]:
        """One call: the given rows advance one token, padding rows write the scratch. The logits
        [size, 1, vocab], and each given row's index in them."""
        active = sorted(tokens_by_row)
        size = next(n for n in self.decode_sizes() if n >= len(active))
        idle = [r for r in range(self.cache.rows) if r not in tokens_by_row]
        # in order: rows filled from the lowest, as the engine fills them, are then consecutive
        rows = sorted(active + idle[:size - len(active)])
        index = {row: i for i, row in enumerate(rows) if row in tokens_by_row}
        tokens = np.zeros((size, 1), dtype=np.int64)
        positions = np.full((size, 1), self.scratch_position, dtype=np.int64)
        for row, i in index.items():
            tokens[i, 0], positions[i, 0] = tokens_by_row[row], self.lengths[row]
        out = self._forward(tokens, positions, np.array(rows, dtype=np.int64), None)
        for row in active:
            self.lengths[row] += 1
        return out, index

    def _sampler(self, row: int, sampling: Sampling) -> tuple[Sampling, Any]:
        """The row's random stream, kept from step to step while its sampling stays the same."""
        kept = self._samplers.get(row)
        if kept is None or kept[0] != sampling:
            kept = self._samplers[row] = (sampling, self._new_rng(sampling.seed))
        return kept

    def _host_sampler(self, row: int, sampling: Sampling) -> tuple[Sampling, np.random.Generator]:
        """The row's random stream for host draws (rows whose logits a ``Control`` adjusts), kept like
        ``_sampler``'s. A seed gives a stream of its own, apart from the device's for the same seed: a row
        that draws on both sides (a ban that ends after ``min_tokens``) does not replay its own numbers."""
        kept = self._host_samplers.get(row)
        if kept is None or kept[0] != sampling:
            rng = np.random.default_rng(None if sampling.seed is None else (sampling.seed, HOST_STREAM))
            kept = self._host_samplers[row] = (sampling, rng)
        return kept

    # -- checks --------------------------------------------------------------------------------
    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.cache.rows:
            raise LinnetError(f"row {row} is outside the cache's {self.cache.rows} rows")

    def _check_prefill(self, row: int, tokens: Sequence[int], start: int) -> None:
        if not tokens:
            raise LinnetError("prefill needs at least one token")
        held = self.lengths[row]
        if not 0 <= start <= held:
            raise LinnetError(f"prefill at position {start} leaves a gap: row {row} holds {held}")
        for slots, window in self.rings:  # a ring keeps the last N written: the window before start must be there
            if _ring_lost(slots, window, held, start):
                raise LinnetError(f"prefill at position {start} of row {row}, which holds {held}: its sliding layers' "
                                  f"ring caches ({slots} positions) no longer hold the {window - 1} before it; "
                                  "reset the row and prefill it from 0")
        self._check_fits(start + len(tokens))
        self._check_tokens(tokens)

    def _check_chunk(self) -> None:
        if self.ring_chunk is not None and self.prefill_chunk > self.ring_chunk:
            raise LinnetError(f"prefill_chunk {self.prefill_chunk} is longer than the {self.ring_chunk} tokens the "
                              "sliding layers' ring caches were sized for; give the chunk in CacheShape(chunk=...)")

    def _check_fits(self, length: int) -> None:
        if length > self.cache.positions:
            raise CacheFull(
                f"{length} tokens do not fit in the KV cache of {self.cache.positions} positions; "
                "use a shorter prompt, fewer new tokens, or a larger --cache-positions"
            )

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise TokenError(f"token ids {bad[:5]} are outside the vocabulary of {self.spec.vocab_size}")
