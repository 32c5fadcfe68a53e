"""The serving engine: continuous batching of many requests over a runner's fixed cache rows.

One thread owns the runner and calls its batched ``step`` in a loop (a ``ModelThread``, given or the
engine's own: build the runner there too, ``thread.run(create_runner, ...)``, since a torch runner
stepped on another thread than the one it was built and warmed up on runs slower). Each request gets a
cache row of its own; a request that finds every row busy waits in a bounded queue. Each step feeds
every running row: a decoding row its last token, a row still reading its prompt the next chunk of it
(at most ``prefill_tokens`` prompt tokens per step over all rows, ``STEP_PROMPT_TOKENS`` by default, so
a long prompt delays the streams already decoding by a bounded step; each prompt's first token goes out
as soon as that prompt is read, and a request that comes while a step reads prompts joins that reading
at its next model call). A request that finishes (EOS, stop id, stop string, max tokens, a full row) or
is cancelled frees its row at once; a waiting one takes it at the next step, or at the step's next
prompt call.

Prefix caching (on unless ``prefix_cache=False``): a freed row keeps the tokens it wrote warm, and a request
takes the free row holding the longest prefix of its prompt (``Runner.can_keep``: as far as sliding layers'
ring caches still hold it), reading only the rest; a request that finds none takes, of the rows that do
not widen the span of the running ones, an empty row, else the row freed longest ago, so that the
conversations served last keep theirs; a running row is never shared. Where a running row holds a longer
prefix of the prompt (``SHARED_MIN`` tokens or more), it is copied into the new request's row
(``Runner.copy_row``), and a request whose prefix a running row is still to read waits for that read to
copy it: a burst of requests with one system prompt reads it once, not once per request.
One engine runs one runner, so nothing is reused across models or dtypes.

Choices of one prompt (``submit_choices``: ``n``, ``best_of``) read it once: the first is admitted as any
request, and the others wait behind it, holding the queue, until its prompt's last chunk is read. That call
forks them (``Prefill.forks``): each takes a free row, gets the prompt's cache by ``Runner.copy_row`` and
draws its own first token from the same logits with its own sampling, then decodes as any row. Choices
that find no free row then wait as any request, and read the prompt themselves (prefix caching reuses
what a freed row of their group holds).

Callers on any thread use ``submit`` (validates, then queues or refuses) and ``Request.cancel``; events
come back through the request's ``on_event`` callback, called on the engine thread (keep it quick: the
HTTP side hands each event to its event loop with ``call_soon_threadsafe``), or, without a callback,
through ``Request.events()``.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from linnet.backends.runner import CACHE_FULL, MAX_TOP_LOGPROBS, OK, Control, Decode, Prefill, RowResult, Runner
from linnet.errors import LinnetError
from linnet.generation.text import TextStream
from linnet.sampling import Sampling
from linnet.serve.logits import Constraint, Penalties, RowLogits, TokenLogprob
from linnet.serve.metrics import Metrics
from linnet.serve.model_thread import ModelThread
from linnet.serve.speculation import Speculation, speculates
from linnet.speculative import Proposal, Speculator
from linnet.tokenizer import Tokenizer

log = logging.getLogger("linnet.serve")

STOP, LENGTH, CANCELLED, ERROR = "stop", "length", "cancelled", "error"

# Prompt tokens a step takes over all rows: vLLM's CPU server's budget. A burst of prompts is read in a
# step or two rather than 256 tokens a step, each beside a decode step of the rows already running: the
# last first token of the burst comes sooner, the median one later (SmolLM2, 16 prompts at once: p99
# 1408 against 1863 ms, p50 1233 against 498; docs/SERVE.md).
STEP_PROMPT_TOKENS = 2048
# A prefix a running row holds, or is about to read, is copied into a new request's row rather than read
# again (``Runner.copy_row``) from this many tokens on: a copy of every layer's keys and values, or a wait
# for the other row's next prompt call, costs about what reading a few tens of tokens does.
SHARED_MIN = 64


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their beginnings."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class RequestError(LinnetError):
    """A request the engine cannot run as asked; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class QueueFull(LinnetError):
    """Every row is busy and the queue holds as many requests as it may."""


@dataclass(frozen=True)
class Params:
    """How one request generates. ``max_tokens=None`` fills the rest of its cache row. The logits work
    (penalties, ``logit_bias``, ``min_tokens``, ``constraint``) is ``linnet.serve.logits``'."""

    max_tokens: int | None = 16
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()  # strings that end the text (never shown)
    stop_ids: tuple[int, ...] = ()  # token ids that end it, as EOS does
    ignore_eos: bool = False
    logprobs: int | None = None  # report each token's logprob and this many top alternatives (0..20)
    penalties: Penalties = Penalties()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # EOS and stop ids are banned until this many tokens are generated
    constraint: Constraint | None = None  # a grammar the tokens follow; its own object per request
    prompt_logprobs: int | None = None  # ``logprobs`` for the prompt's tokens (its row reads it all: no prefix reuse)


@dataclass(frozen=True)
class Event:
    """What a request produced since its last event; the last one has a ``finish_reason``."""

    text: str  # text now safe to show: whole characters, nothing that could begin a stop string
    token_ids: tuple[int, ...]  # tokens sampled (an ending EOS or stop id is not among them)
    finish_reason: str | None = None  # STOP, LENGTH, CANCELLED or ERROR
    prompt_tokens: int = 0
    completion_tokens: int = 0  # every token sampled, an ending EOS or stop id included
    error: str = ""
    cached_tokens: int = 0  # prompt tokens whose keys and values the row already held (prefix caching)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token of ``token_ids``, when the request asked
    # with ``prompt_logprobs``, in the first event: one per prompt token after the first
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class Completion:
    """A whole request's outcome, gathered from its events."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str = ""
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def cumulative_logprob(self) -> float:
        """The sum of its tokens' logprobs (those it returns: an ending EOS or stop id is not among them)."""
        return sum(t.logprob for t in self.logprobs)


class Request:
    """A submitted request: its handle for cancelling and, without a callback, for reading its events."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: Params,
                 on_event: Callable[[Event], object] | None):
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.params = params
        self.row: int | None = None  # the cache row it runs in, once admitted
        # a later choice of one prompt: the first choice, until whose prompt is read it waits to fork from it
        self.leader: Request | None = None
        self.followers: list[Request] = []  # a first choice's: the choices waiting to fork from it
        self.submitted = time.perf_counter()
        self.done = False
        self._events: queue.Queue[Event] | None = None
        self._ended = False  # its last event was read (events() ends there; result() keeps what it read)
        self._result: Completion | None = None
        self._on_event: Callable[[Event], object]
        if on_event:
            self._on_event = on_event
        else:
            self._events = queue.Queue()
            self._on_event = self._events.put

    def cancel(self) -> None:
        """Stop generating and free the row (from any thread; nothing happens once it has finished)."""
        self.engine._cancel(self)

    def events(self) -> Iterator[Event]:
        """The request's events, as they come, until its last (only for requests without a callback)."""
        if self._events is None:
            raise LinnetError("this request delivers its events to its callback")
        if self._ended:
            raise LinnetError("this request's events were read already: result() keeps its completion")
        while True:
            event = self._events.get()
            if event.finish_reason:
                self._ended = True
            yield event
            if event.finish_reason:
                return

    def result(self) -> Completion:
        """Wait for the end; the whole text, tokens and counts (the same completion when asked again)."""
        if self._result is not None:
            return self._result
        text: list[str] = []
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        prompt_logprobs: list[TokenLogprob] = []
        for event in self.events():
            text.append(event.text)
            tokens += event.token_ids
            logprobs += event.logprobs
            prompt_logprobs += event.prompt_logprobs
        assert event.finish_reason is not None  # events() ends with the last
        self._result = Completion("".join(text), tokens, event.finish_reason, event.prompt_tokens,
                                  event.completion_tokens, event.error, event.cached_tokens, logprobs,
                                  prompt_logprobs)
        return self._result


@dataclass
class _Running:
    """The engine thread's state of one admitted request."""

    request: Request
    stream: TextStream | None
    stops: frozenset[int]
    max_tokens: int
    logits: RowLogits
    fed: int = 0  # prompt tokens written so far, the cached ones included
    cached: int = 0  # prompt tokens the row held already
    forked: bool = False  # the row took the prompt's cache from its first choice's row (``Prefill.forks``)
    last: int | None = None  # the last token sampled, fed back in the next step
    sampled: int = 0
    generated: list[int] = field(default_factory=list)  # every token sampled
    speculator: Speculator | None = None  # with the engine's speculation, once the row first speculates
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # until the first event carries them

    def take_prompt_logprobs(self) -> tuple[TokenLogprob, ...]:
        taken, self.prompt_logprobs = tuple(self.prompt_logprobs), []
        return taken

    def written(self) -> list[int]:
        """The tokens whose keys and values the row holds: the prompt as far as it was read, and every token
        sampled but the last (each is written when it is fed back)."""
        return self.request.prompt_ids[:self.fed] + self.generated[:-1]

    def decode(self, row: int) -> Decode:
        """The next decode step of a row whose prompt has been read (and so has sampled)."""
        assert self.last is not None
        return Decode(row, self.last)

    def control(self) -> Control | None:
        """This step's work on the row's logits on the host, or None (its token is drawn where the model runs)."""
        adjust, logprobs = self.logits.adjust(), self.request.params.logprobs
        return None if adjust is None and logprobs is None else Control(adjust, logprobs)


class Engine:
    def __init__(self, runner: Runner, tokenizer: Tokenizer | None = None, max_queue: int = 256,
                 prefill_tokens: int = STEP_PROMPT_TOKENS, thread: ModelThread | None = None,
                 prefix_cache: bool = True, speculation: Speculation | None = None):
        if max_queue < 0:
            raise LinnetError(f"max_queue must not be negative, got {max_queue}")
        if prefill_tokens < 1:
            raise LinnetError(f"prefill_tokens must be at least 1, got {prefill_tokens}")
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(tokenizer.eos_ids if tokenizer else ())
        self.max_queue = max_queue
        self.prefill_tokens = prefill_tokens  # prompt tokens per step, all rows
        self.prefix_cache = prefix_cache
        if speculation is not None:
            speculation.check(runner)
        self.speculation = speculation
        self._held: list[list[int]] = [[] for _ in range(runner.cache.rows)]  # a free row's tokens, kept warm
        self.metrics = Metrics()
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._cancels: list[Request] = []
        self._running: dict[int, _Running] = {}  # row -> its request, in order of admission
        self._free = list(range(runner.cache.rows))
        self._freed = [0] * runner.cache.rows  # when each row was last freed, in frees: the oldest is lost first
        self._frees = 0
        self._thread, self._own_thread = thread, thread is None  # the engine's own: made when first needed
        self._loop_done: Future | None = None
        self._stopping = False

    # -- any thread ----------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return self.runner.cache.rows

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def rows_busy(self) -> int:
        return self.rows - len(self._free)

    @property
    def alive(self) -> bool:
        return self._loop_done is not None and not self._loop_done.done()

    def max_tokens_for(self, prompt_tokens: int) -> int:
        """The most tokens a prompt of this length leaves room for (the last one is never fed back)."""
        return self.runner.cache.positions - prompt_tokens + 1

    def submit(self, prompt_ids: Sequence[int], params: Params = Params(),
               on_event: Callable[[Event], object] | None = None) -> Request:
        """Queue a request, or raise ``RequestError`` (it cannot run as asked) or ``QueueFull``."""
        return self.submit_choices(prompt_ids, [params], [on_event])[0]

    def submit_choices(self, prompt_ids: Sequence[int], params: Sequence[Params],
                       on_events: Sequence[Callable[[Event], object] | None]) -> list[Request]:
        """Queue a request per ``params`` (and its callback), all of the one prompt, which is read once: the
        others fork from the first's row once it is read. All are queued, or none (``RequestError``,
        ``QueueFull``)."""
        prompt_ids = list(prompt_ids)
        if not params or len(params) != len(on_events):
            raise LinnetError(f"submit_choices takes a callback per choice: {len(params)} choices, "
                              f"{len(on_events)} callbacks")
        for choice in params:
            self._check(prompt_ids, choice)
        requests = [Request(self, prompt_ids, choice, on_event) for choice, on_event in zip(params, on_events)]
        leader, *followers = requests
        leader.followers = followers
        for follower in followers:
            follower.leader = leader
        with self._cond:
            if self._stopping:
                raise LinnetError("the engine is stopping")
            # free rows take theirs next step
            if len(self._waiting) + len(requests) > self.max_queue + len(self._free):
                self.metrics.refuse()
                raise QueueFull(f"all {self.rows} rows are busy and {len(self._waiting)} requests wait; "
                                "try again later")
            self._waiting.extend(requests)
            self._cond.notify()
        return requests

    @property
    def thread(self) -> ModelThread:
        """The thread that warms up and steps the runner."""
        if self._thread is None:
            self._thread = ModelThread()
        return self._thread

    def start(self) -> Engine:
        with self._cond:
            if self._loop_done is None:
                self._loop_done = self.thread.submit(self._loop)
        return self

    def stop(self) -> None:
        """Finish every request (CANCELLED, 'the engine stopped') and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._loop_done is not None:
            self._loop_done.result()
        else:  # never started: end the queued requests here
            self._end_all("the engine stopped")
        if self._own_thread and self._thread is not None:
            self._thread.close()

    def warm_up(self) -> float:
        """The runner's warm-up (a prompt chunk, and a decode step at each of its decode sizes, on the
        scratch position) before serving: compiled backends compile every shape the engine will run
        here, not in someone's request (a decode size first met under load stalled every row for the
        length of its compile), speculation's checks included. Call before ``start``; runs on the engine's
        thread; the seconds it took."""
        s = self.speculation
        verify = None if s is None else (s.rows, s.draft_tokens + 1)
        return self.thread.run(self.runner.warm_up, verify)

    def _check(self, prompt_ids: list[int], params: Params) -> None:
        positions, vocab = self.runner.cache.positions, self.runner.spec.vocab_size
        if not prompt_ids:
            raise RequestError("the prompt is empty", "prompt")
        if len(prompt_ids) > positions:  # before the ids are scanned: a long list is refused at once
            raise RequestError(f"the prompt has {len(prompt_ids)} tokens, more than a cache row's {positions} "
                               "positions", "prompt", "context_length_exceeded")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must lie in 0..{vocab - 1}", "prompt")
        if params.max_tokens is not None:
            if params.max_tokens < 1:
                raise RequestError(f"max_tokens must be at least 1, got {params.max_tokens}", "max_tokens")
            room = self.max_tokens_for(len(prompt_ids))
            if params.max_tokens > room:
                raise RequestError(
                    f"a cache row holds {positions} positions: the prompt's {len(prompt_ids)} tokens leave room "
                    f"for at most {room} new tokens, but max_tokens is {params.max_tokens}", "max_tokens",
                    "context_length_exceeded")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this engine has none", "stop")
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(params, name)
            if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
                raise RequestError(f"{name} asks for {count} top alternatives; 0..{MAX_TOP_LOGPROBS} are possible",
                                   name)
        bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"logit_bias names token ids {bad[:5]} outside the vocabulary 0..{vocab - 1}",
                               "logit_bias")
        if params.min_tokens < 0 or (params.max_tokens is not None and params.min_tokens > params.max_tokens):
            raise RequestError(f"min_tokens must be in 0..max_tokens ({params.max_tokens}), got {params.min_tokens}",
                               "min_tokens")
        if params.penalties.repetition <= 0:
            raise RequestError(f"repetition_penalty must be above 0, got {params.penalties.repetition}",
                               "repetition_penalty")

    def _cancel(self, request: Request) -> None:
        with self._cond:
            if not request.done:
                self._cancels.append(request)
                self._cond.notify()

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._iterate()
            except Exception as e:  # the runner (or a bug) failed: end what ran, keep serving the rest
                log.exception("an engine step failed")
                for run in list(self._running.values()):
                    self._end(run.request, ERROR, f"the model step failed: {e}")
        self._end_all("the engine stopped")

    def _iterate(self) -> None:
        with self._cond:
            while not (self._stopping or self._waiting or self._running or self._cancels):
                self._cond.wait()
            cancels, self._cancels = self._cancels, []
        for request in cancels:
            self._end(request, CANCELLED)
        self._admit_waiting()
        if self._running and not self._stopping:
            self._step()

    def _admit_waiting(self) -> None:
        """Give each waiting request a free row, in order of arrival, while there are both. A choice waiting to
        fork from its first choice (``submit_choices``) holds the queue: it would have taken a row now; so does
        a request whose prompt's prefix a running row is about to read (``_shares_unread``), to copy it then."""
        with self._cond:
            while (self._waiting and self._free and not self._stopping and self._waiting[0].leader is None
                   and not self._shares_unread(self._waiting[0])):
                self._admit(self._waiting.popleft())

    def _admit(self, request: Request) -> None:
        row, keep = self._pick_row(request.prompt_ids)
        if request.params.prompt_logprobs is not None:
            keep = 0  # a cached prefix has no logits to score its tokens with
        source, shared = self._running_prefix(request)
        if shared - keep >= SHARED_MIN:  # a running row holds more of it: copied into a spare row
            row, keep = self._spare_row(), shared
            self._free.remove(row)
            self.runner.copy_row(source, row, keep)
        else:
            self._free.remove(row)
            self.runner.reset(row, keep)
        self._running[row] = self._run_in(row, request, keep, keep)

    def _running_prefix(self, request: Request) -> tuple[int, int]:
        """The running row holding the longest prefix of ``request``'s prompt (its last token always read), and
        that prefix's length (0: none)."""
        best = (-1, 0)
        if self.prefix_cache and request.params.prompt_logprobs is None:
            for row, run in self._running.items():
                n = common_prefix(run.written(), request.prompt_ids[:-1])
                if n > best[1] and self.runner.can_keep(row, n):
                    best = (row, n)
        return best

    def _shares_unread(self, request: Request) -> bool:
        """Whether a running row is still to read a prefix of ``request``'s prompt at least ``SHARED_MIN`` tokens
        longer than any row holds now: the request waits for that read, to copy it."""
        if not self.prefix_cache or request.params.prompt_logprobs is not None:
            return False
        prompt = request.prompt_ids[:-1]
        coming = max((shared for run in self._running.values()
                      if run.fed < (shared := common_prefix(run.request.prompt_ids, prompt))), default=0)
        if coming < SHARED_MIN:
            return False
        held = max(self._pick_row(request.prompt_ids)[1], self._running_prefix(request)[1])
        return coming - held >= SHARED_MIN

    def _run_in(self, row: int, request: Request, fed: int, cached: int, forked: bool = False,
                prompt_logprobs: Sequence[TokenLogprob] = ()) -> _Running:
        """The state of ``request`` admitted to ``row``, whose runner row holds (or, forked, will hold) its
        first ``fed`` prompt tokens."""
        params = request.params
        stops = frozenset(params.stop_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        stream = TextStream(self.tokenizer, params.stop) if self.tokenizer else None
        max_tokens = params.max_tokens or self.max_tokens_for(len(request.prompt_ids))
        request.row = row
        self._held[row] = []
        # min_tokens bans what would end the request: EOS (unless ignored) and the stop ids, as vLLM does
        logits = RowLogits(request.prompt_ids, params.penalties, params.logit_bias, params.min_tokens, tuple(stops),
                           params.constraint)
        return _Running(request, stream, stops, max_tokens, logits, fed=fed, cached=cached, forked=forked,
                        prompt_logprobs=list(prompt_logprobs))

    def _fork(self, leader: _Running) -> tuple[int, ...]:
        """Rows for the choices waiting on ``leader``, whose prompt's last chunk the next call reads, as many
        as are free; the others are let go to wait as any request. The forks' rows, for ``Prefill.forks``."""
        rows = []
        with self._cond:
            followers, leader.request.followers = leader.request.followers, []
            for follower in followers:
                follower.leader = None
                # a fork's prompt logprobs are its first choice's: only a like request may take them
                if (follower.done or not self._free or self._stopping
                        or follower.params.prompt_logprobs != leader.request.params.prompt_logprobs):
                    continue
                self._waiting.remove(follower)
                row = self._spare_row()
                self._free.remove(row)
                self._running[row] = self._run_in(row, follower, len(follower.prompt_ids), leader.cached, forked=True,
                                                  prompt_logprobs=leader.prompt_logprobs)
                rows.append(row)
        return tuple(rows)

    def _let_go(self, request: Request) -> None:
        """The choices waiting to fork from ``request``, which ended before its prompt was read, wait as any
        request."""
        with self._cond:
            for follower in request.followers:
                follower.leader = None
            request.followers = []

    def _pick_row(self, prompt: list[int]) -> tuple[int, int]:
        """The free row that holds the longest prefix of ``prompt`` the runner can keep (``Runner.can_keep``:
        sliding layers' rings may have lost it), and that prefix's length; where none holds any, the row
        whose loss costs least (``_spare_row``). The prompt's last token is always read, for the logits of
        the first new token."""
        best = (0, self._spare_row())
        if self.prefix_cache:
            for row in sorted(self._free):
                n = common_prefix(self._held[row], prompt[:-1])
                if n > best[0] and self.runner.can_keep(row, n):
                    best = (n, row)
        return best[1], best[0]

    def _spare_row(self) -> int:
        """The free row to give a request that finds no prefix of its own. First one that does not widen the
        span of the running rows (ONNX Runtime's CPU runner steps every row from the lowest running one to
        the highest, idle ones too); among those one that holds nothing, else the one freed longest ago (as
        an LRU cache evicts), so that the prefixes freed last stay for their follow-ups."""
        running = self._running.keys()
        low, high = (min(running), max(running)) if running else (0, self.rows)

        def widening(row: int) -> int:
            return max(low - row, row - high, 0)

        return min(self._free, key=lambda row: (widening(row), bool(self._held[row]), self._freed[row], row))

    def _step(self) -> None:
        """Read prompts, a model call at a time, up to the step's budget; then decode the rows whose
        prompts were read before the step began, one call for all. Requests that come while the prompts
        are read join the reading at the next call rather than after the step: a burst's late arrivals
        would otherwise wait a whole step of other prompts before theirs began (Qwen's shapes, 16 at a
        time: the later waves' last first tokens at 6.2-6.5 s; docs/NOTEBOOK.md)."""
        decoding = [(run, run.decode(row)) for row, run in self._running.items()
                    if run.fed == len(run.request.prompt_ids)]
        started, sampled, budget = time.perf_counter(), 0, self.prefill_tokens
        while budget and not self._stopping:
            group = self._next_prompt_group(budget)
            if not group:
                break
            sampled += self._call(prefill=group)
            budget -= sum(len(p.tokens) for p in group)
            self._admit_waiting()
        decode = [d for run, d in decoding if self._running.get(d.row) is run]
        if decode and self.speculation is not None and len(self._running) <= self.speculation.rows:
            verified, decode = self._speculate(decode)
            sampled += verified
        if decode:
            sampled += self._call(decode=decode)
        now = time.perf_counter()
        self.metrics.step(now - started, sampled, now)

    def _next_prompt_group(self, budget: int) -> list[Prefill]:
        """The next model call's prompt chunks, within ``budget`` tokens: the runner's first group
        (``Runner.prompt_groups``: a chunk, or short prompts it reads together) of the rows still reading,
        taken in order of admission, so the longest-waiting prompt is read first."""
        prefill = []
        for row, run in self._running.items():
            prompt = run.request.prompt_ids
            take = min(budget, len(prompt) - run.fed)
            if take > 0:
                prefill.append(Prefill(row, prompt[run.fed:run.fed + take], run.fed, run.fed + take == len(prompt),
                                       run.request.params.prompt_logprobs))
                budget -= take
        if not prefill:
            return []
        group = self.runner.prompt_groups(prefill)[0]
        for p in group:
            self._running[p.row].fed += len(p.tokens)
        # the prompt's last chunk: the choices waiting on it fork from it in this call
        return [replace(p, forks=self._fork(run)) if p.sample and (run := self._running[p.row]).request.followers
                else p for p in group]

    def _call(self, prefill: Sequence[Prefill] = (), decode: Sequence[Decode] = ()) -> int:
        """One runner step over a group of prompt chunks or the decoding rows; how many tokens it sampled."""
        rows = [p.row for p in prefill if p.sample] + [f for p in prefill for f in p.forks] + [d.row for d in decode]
        sampling = {row: self._running[row].request.params.sampling for row in rows}
        controls = {row: control for row in rows if (control := self._running[row].control()) is not None}
        sampled = 0
        for row, result in self.runner.step(prefill=prefill, decode=decode, sampling=sampling,
                                            controls=controls).items():
            sampled += result.token is not None
            self._advance(self._running[row], result)
        return sampled

    def _speculate(self, decode: list[Decode]) -> tuple[int, list[Decode]]:
        """Check the drafts of the decoding rows that speculate (``linnet.serve.speculation``), at most
        ``Speculation.drafts_each`` a row, in one ``Runner.verify`` that takes the speculating rows without
        drafts too (their last token alone), so the step reads the weights once; the tokens it gave, and
        the rows left to decode as usual (all of them where no row has drafts)."""
        assert self.speculation is not None
        speculating: list[Decode] = []
        rest: list[Decode] = []
        for d in decode:
            run = self._running[d.row]
            (speculating if speculates(run.request.params.sampling, run.control() is not None) else rest).append(d)
        if not speculating:
            return 0, decode
        each = self.speculation.drafts_each(len(speculating))
        proposals: dict[int, Proposal | None] = {}
        for d in speculating:
            run = self._running[d.row]
            if run.speculator is None:
                run.speculator = self.speculation.speculator(self.runner, d.row, run.request.params.sampling)
            room = min(run.max_tokens - run.sampled, each + 1)
            proposal = run.speculator.propose([*run.request.prompt_ids, *run.generated], room)
            if proposal is None and self.runner.lengths[d.row] >= self.runner.cache.positions:
                rest.append(d)  # a full row: its decode reports it
            else:
                proposals[d.row] = proposal
        if not any(proposals.values()):
            return 0, decode
        logits = self.runner.verify({row: [self._running[row].decode(row).token, *(p.tokens if p else [])]
                                     for row, p in proposals.items()})
        sampled = 0
        for row, proposal in proposals.items():
            run = self._running[row]
            assert run.speculator is not None
            if proposal is None:
                tokens = run.speculator.settle_one(logits[row])
            else:
                tokens = run.speculator.settle(logits[row], proposal)
                self.metrics.speculated(len(proposal.tokens), len(tokens) - 1)
            sampled += len(tokens)
            self._take(run, tokens)
        return sampled, rest

    def _advance(self, run: _Running, result: RowResult) -> None:
        request = run.request
        if result.status == CACHE_FULL:
            return self._end(request, LENGTH)
        if result.status != OK:
            return self._end(request, ERROR, result.message)
        run.prompt_logprobs += [TokenLogprob(t, lp, tuple(top)) for t, lp, top in result.prompt_logprobs]
        if result.token is None:  # a prompt chunk that is not the last
            return
        token = result.token
        logprobs = () if result.logprob is None else (TokenLogprob(token, result.logprob, tuple(result.top_logprobs)),)
        self._take(run, [token], logprobs)

    def _take(self, run: _Running, tokens: Sequence[int], logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        """The row's new tokens, in order (one, or a speculated row's kept drafts and its own), sent as one
        event; the first that ends the request ends it, and the row's length drops what followed it."""
        request, constraint = run.request, run.request.params.constraint
        pieces: list[str] = []
        taken: list[int] = []

        def end(reason: str, error: str = "") -> None:
            if request.row is not None:  # a speculated row wrote the tokens after this one: not counted
                self.runner.lengths[request.row] = min(self.runner.lengths[request.row], len(run.written()))
            self._end(request, reason, error, "".join(pieces), tuple(taken), logprobs if taken else ())

        for token in tokens:
            run.sampled += 1
            run.generated.append(token)
            if run.sampled == 1:
                self.metrics.first_token(time.perf_counter() - request.submitted)
            run.logits.accept(token)
            if constraint is not None:
                try:
                    constraint.accept(token)
                except Exception as e:  # this request's grammar failed: end it, not every row
                    log.exception("a request's constraint failed")
                    return end(ERROR, f"the output constraint failed: {e}")
            if token in run.stops:
                return end(STOP)
            run.last = token
            pieces.append(run.stream.feed(token) if run.stream else "")
            taken.append(token)
            if (run.stream and run.stream.stopped) or (constraint is not None and constraint.finished):
                return end(STOP)
            if run.sampled == run.max_tokens:
                return end(LENGTH)
        self._emit(request, Event("".join(pieces), tuple(taken), logprobs=logprobs,
                                  prompt_logprobs=run.take_prompt_logprobs()))

    def _end(self, request: Request, reason: str, error: str = "", text: str = "",
             tokens: tuple[int, ...] = (), logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        """The request's last event; its row (or its place in the queue) is free at once."""
        if request.done:
            return
        request.done = True
        self._let_go(request)
        row = request.row
        run = self._running.pop(row, None) if row is not None else None
        if row is not None and run is not None:
            held = run.written() if self.prefix_cache and reason != ERROR else []
            if len(held) != self.runner.lengths[row]:  # not what the runner wrote: keep nothing
                held = []
            self.runner.reset(row, len(held))
            self._held[row] = held
            self._frees += 1
            self._freed[row] = self._frees
            self._free.append(row)
            if run.stream and not run.stream.stopped and reason != CANCELLED:
                text += run.stream.finish()
        else:
            with self._cond:
                if request in self._waiting:
                    self._waiting.remove(request)
        read = run.fed - run.cached if run and not run.forked else 0
        self.metrics.finished(reason, read, run.cached if run and not run.forked else 0,
                              run.fed if run and run.forked else 0)
        self._emit(request, Event(text, tokens, reason, len(request.prompt_ids), run.sampled if run else 0, error,
                                  run.cached if run else 0, logprobs, run.take_prompt_logprobs() if run else ()))

    def _end_all(self, error: str) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for request in [run.request for run in self._running.values()] + waiting:
            self._end(request, CANCELLED, error)

    def _emit(self, request: Request, event: Event) -> None:
        try:
            request._on_event(event)
        except Exception:  # a consumer that cannot take events any more (its event loop closed)
            log.exception("a request's event callback failed; cancelling it")
            if not request.done:
                self._cancel(request)
