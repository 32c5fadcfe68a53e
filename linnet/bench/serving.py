"""The serving benchmark: servers (OpenAI-compatible ones, and Triton hosting linnet.serve), each started and
stopped in turn, driven over HTTP by N requests of random prompt lengths and fixed new tokens, at most C in
flight, timed at the client. A profile of several turns makes the requests conversations: a turn's prompt is
the previous turn's and more, sent once that one has been answered (``random_load``).

Every server gets the same prompts (token ids drawn with a fixed seed) and must return exactly
``new_tokens`` tokens for each (greedy, the end-of-sequence token ignored). A row's ``serve_tok_s`` is all
completion tokens over the wall time of the whole load; ``serve_ttft_ms`` the median time to first token,
its samples one per request; ``load_s`` from starting the server to its answering a first one-token request;
``peak_mem_gib`` the largest resident memory of the server's processes, sampled while it ran.

A ``+json`` server's requests each carry one JSON schema (``json_schema_format``) that no answer of
``new_tokens`` tokens can complete, so that it too returns every token; its row is compared with the same
server unconstrained, and a Ray Serve row with ``linnet serve`` alone on the same backend, where those ran.
"""
from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from linnet.bench import arithmetic, machine
from linnet.bench.harness import importable_here, worker_environment
from linnet.bench.serving_client import Load, ServingError, run_load
from linnet.bench.serving_servers import (
    JSON_ROWS,
    RAY_ROWS,
    ROUND_ROBIN_ROWS,
    SPECULATIVE_ROWS,
    TRITON_ROWS,
    NotRunnable,
    Running,
    Server,
    free_port,
    make_server,
    server_ids,
)
from linnet.bench.workloads import WORKLOAD_NAMES, chat_ids, workload_prompts
from linnet.errors import LinnetError
from linnet.model import open_model, open_spec, resolve
from linnet.registry.schema import Protocol, Serving
from linnet.results import SERVING_GROUP, Against, Machine, Metric, Results, Row

PROMPT_SEED = 0
WARM_UP_SEED = 1


@dataclass(frozen=True)
class ServingProfile:
    name: str
    requests: int
    prompt_min: int  # with several turns: a conversation's opening (its first turn's prompt)
    prompt_max: int
    new_tokens: int
    concurrency: int  # requests in flight at most: the servers' rows
    shared: int = 0  # tokens every prompt begins with (a system prompt), counted in its length
    turns: int = 1  # a conversation's requests: each later turn's prompt is the previous one's plus turn_tokens
    turn_tokens: tuple[int, int] = (0, 0)  # the least and most tokens a later turn adds
    # the prompts: "" random token ids; else a workload of ``linnet.bench.workloads`` ("copying": answers that
    # copy the prompt), its chat prompts in turn, each at most ``prompt_max`` tokens
    workload: str = ""

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise LinnetError(f"profile {self.name}: turns must be at least 1, got {self.turns}")
        if self.requests % self.turns:
            raise LinnetError(f"profile {self.name}: {self.requests} requests are not whole conversations of "
                              f"{self.turns} turns: --requests must be a multiple of {self.turns}")
        low, high = self.turn_tokens
        if self.workload and (self.workload not in WORKLOAD_NAMES or self.turns > 1 or self.shared):
            raise LinnetError(f"profile {self.name}: a workload is one of {', '.join(WORKLOAD_NAMES)}, in one turn "
                              "without a shared prefix")
        if self.turns > 1 and not 1 <= low <= high:
            raise LinnetError(f"profile {self.name}: turn_tokens needs 1 <= least <= most, got {self.turn_tokens}")

    @property
    def conversations(self) -> int:
        return self.requests // self.turns

    @property
    def longest_prompt(self) -> int:
        return self.prompt_max + (self.turns - 1) * self.turn_tokens[1]

    @property
    def positions(self) -> int:
        return self.longest_prompt + self.new_tokens

    def serving(self) -> Serving:
        return Serving(self.requests, self.prompt_min, self.longest_prompt, self.new_tokens, self.concurrency)

    def describe(self) -> str:
        if self.workload:
            return (f"{self.requests} requests of the {self.workload} workload's chat prompts in turn (linnet.bench."
                    f"workloads, at most {self.prompt_max} tokens) and {self.new_tokens} new tokens, at most "
                    f"{self.concurrency} in flight")
        shared = f" (the first {self.shared} shared by all)" if self.shared else ""
        if self.turns == 1:
            return (f"{self.requests} requests of {self.prompt_min}-{self.prompt_max} prompt tokens{shared} and "
                    f"{self.new_tokens} new tokens, at most {self.concurrency} in flight")
        low, high = self.turn_tokens
        return (f"{self.requests} requests in {self.conversations} conversations of {self.turns} turns, sent turn "
                f"by turn: each opens with {self.prompt_min}-{self.prompt_max} prompt tokens{shared or ' of its own'}, "
                f"and a later turn's prompt is the previous one's and {low}-{high} more (up to "
                f"{self.longest_prompt}); {self.new_tokens} new tokens, at most {self.concurrency} in flight")


PROFILES = {p.name: p for p in (
    ServingProfile("seed", 256, 128, 512, 128, 64),  # the published pages' protocol
    ServingProfile("cpu-prompt", 64, 128, 512, 64, 16),  # prompt-heavy, sized for a CPU
    ServingProfile("cpu-decode", 64, 32, 128, 128, 16),  # decode-heavy
    ServingProfile("cpu-chat", 64, 1024 + 32, 1024 + 128, 64, 16, shared=1024),  # a shared system prompt
    # Conversations: what tells prefix-aware routing from round-robin (in cpu-chat every replica soon holds the
    # one system prompt). cpu-chat's requests, new tokens and longest prompt (768 + 3 x 128 = 1152), so the
    # same positions; a turn adds the previous answer's worth (64) and a user message of up to 64. 16
    # conversations: all in flight at once (16), and all on one replica would still fit its 16 rows.
    ServingProfile("cpu-turns", 64, 512, 768, 64, 16, turns=4, turn_tokens=(64, 128)),
    # Answers that copy their prompt (a passage corrected, code edited, a document quoted, fields extracted),
    # 1 and 4 in flight: where speculative decoding pays (``+ngram`` servers; docs/SPECULATIVE.md)
    ServingProfile("cpu-copying", 16, 1, 256, 128, 4, workload="copying"),
    ServingProfile("cpu-copying-1", 8, 1, 256, 128, 1, workload="copying"),
)}


def random_prompts(vocab_size: int, profile: ServingProfile, seed: int = PROMPT_SEED) -> list[list[int]]:
    return random_load(vocab_size, profile, seed)[0]


def random_load(vocab_size: int, profile: ServingProfile,
                seed: int = PROMPT_SEED) -> tuple[list[list[int]], list[int | None]]:
    """The load's prompts in the order they are sent, and for each the index of the request it follows (its
    conversation's previous turn: sent only once that one has finished) or None.

    With several turns the order is turn by turn (every conversation's turn k before any turn k+1), shuffled
    within a turn: in a fixed order a round-robin router over an even number of replicas would send a
    conversation to the same replica every turn. The answers are not fed back (the prompts are drawn before
    the load), so a row that served turn k holds exactly turn k's prompt as a prefix of turn k+1's."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(profile.prompt_min, profile.prompt_max + 1, profile.conversations)
    # drawn with the seed, so the warm-up's differs (a server must not find the load's in its cache)
    shared = rng.integers(0, vocab_size, profile.shared).tolist() if profile.shared else []
    openings = [shared + rng.integers(0, vocab_size, n - profile.shared).tolist() for n in lengths]
    if profile.turns == 1:
        return openings, [None] * len(openings)
    conversations = [[opening] for opening in openings]
    low, high = profile.turn_tokens
    for _ in range(1, profile.turns):
        for turns in conversations:
            turns.append(turns[-1] + rng.integers(0, vocab_size, int(rng.integers(low, high + 1))).tolist())
    prompts: list[list[int]] = []
    follows: list[int | None] = []
    sent_at = [-1] * profile.conversations  # where each conversation's latest turn is in the load
    for turn in range(profile.turns):
        for c in rng.permutation(profile.conversations).tolist():
            follows.append(sent_at[c] if turn else None)
            sent_at[c] = len(prompts)
            prompts.append(conversations[c][turn])
    return prompts, follows


@dataclass(frozen=True)
class Prompts:
    """The load's prompts, as token ids and as text, and the warm-up request's (which a server answers
    before the load is timed; a compiled server compiles there). The warm-up is drawn with a seed of its
    own: had it been the load's first prompt, a server that caches prefixes (vLLM does by default) would
    find that prompt in its cache (vLLM's first first token of 2026-12-03's runs came in 150 ms, where
    Linnet read all 455 tokens)."""

    ids: list[list[int]]
    texts: list[str]
    warm_up_ids: list[int]
    warm_up_text: str
    response_format: dict[str, Any] | None = None  # what a +json server's requests carry
    follows: list[int | None] | None = None  # per request, the one it waits for (``random_load``); None: none

    @classmethod
    def draw(cls, tokenizer: Any, vocab_size: int, profile: ServingProfile) -> Prompts:
        if profile.workload:
            ids, follows = workload_load(tokenizer, profile), None
            warm_up = fitting_chat_ids(tokenizer, workload_prompts("chat")[0][1], profile)
        else:
            ids, follows = random_load(vocab_size, profile)
            warm_up = random_prompts(vocab_size, profile, WARM_UP_SEED)[0]
        texts = [tokenizer.decode(p, skip_special_tokens=False) for p in [*ids, warm_up]]
        return cls(ids, texts[:-1], warm_up, texts[-1], json_schema_format(tokenizer, profile.new_tokens), follows)

    def sent(self, token_ids: bool) -> tuple[list[int] | str, list[list[int]] | list[str]]:
        """The warm-up and the load as a server takes them: token ids, or text."""
        return (self.warm_up_ids, self.ids) if token_ids else (self.warm_up_text, self.texts)


def workload_load(tokenizer: Any, profile: ServingProfile) -> list[list[int]]:
    """The workload's chat prompts as token ids (the model's chat template), in turn up to the profile's requests."""
    prompts = [fitting_chat_ids(tokenizer, text, profile) for _, text in workload_prompts(profile.workload)]
    return [prompts[i % len(prompts)] for i in range(profile.requests)]


def fitting_chat_ids(tokenizer: Any, text: str, profile: ServingProfile) -> list[int]:
    """``chat_ids``, refused where longer than the profile's prompts may be."""
    ids = chat_ids(tokenizer, text)
    if len(ids) > profile.prompt_max:
        raise LinnetError(f"profile {profile.name}: a prompt of its workload takes {len(ids)} tokens with this "
                          f"model's chat template, more than the {profile.prompt_max} it allows")
    return ids


def json_schema_format(tokenizer: Any, new_tokens: int) -> dict[str, Any]:
    """The ``response_format`` of a +json server's requests: an object of one string at least as long as
    ``new_tokens`` of the vocabulary's longest tokens, so no answer of that many tokens completes it (a
    completed grammar would end the request early, whatever ``ignore_eos`` says). A token's text in the
    vocabulary is no shorter than the characters it decodes to (byte-level: a character a byte or more)."""
    longest = max(len(token) for token in tokenizer.hf.get_vocab())
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": (new_tokens + 1) * longest}},
              "required": ["text"], "additionalProperties": False}
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema, "strict": True}}


def serving_rows(model: str, servers: list[str], profile: ServingProfile, dtype: str, threads: int | None,
                 log: Any = sys.stderr, rounds: int = 1, replicas: int = 1) -> list[Row]:
    """One row per server, in the order given; a server that cannot run is a row "not run: reason".

    With several ``rounds`` each server is started and measured once a round, every other round in the
    reverse order (A B, B A, A B, ...): on a VM whose speed drifts over minutes, whichever server runs
    first in a single round gains or loses by its place, not by itself. A row then holds the median of the
    rounds' throughputs, with every round's as samples, and the first tokens of all rounds together.
    ``replicas``: how many a ``ray:BACKEND`` server runs."""
    path = resolve(model)
    loaded = open_model(str(path))
    if loaded.tokenizer is None:
        raise LinnetError(f"{path} has no tokenizer.json; linnet serve and the peers' text prompts need one")
    if rounds < 1:
        raise LinnetError(f"rounds must be at least 1, got {rounds}")
    hf_dir = path if path.is_dir() else None
    prompts = Prompts.draw(loaded.tokenizer, loaded.spec.vocab_size, profile)
    threads = threads or machine.cores()
    rows: list[Row] = []
    for spec in servers:
        try:
            row_id, name, linnet = server_ids(spec, replicas)
            rows.append(Row(row_id, SERVING_GROUP, name, linnet=linnet))
        except NotRunnable as e:
            rows.append(Row(spec, SERVING_GROUP, spec, not_run=str(e)))
    runs: list[list[Run]] = [[] for _ in servers]
    for n in range(rounds):
        order = range(len(servers)) if n % 2 == 0 else reversed(range(len(servers)))
        for i in order:
            if rows[i].not_run:
                continue
            print(f"linnet bench-serve: {servers[i]}{f' (round {n + 1} of {rounds})' if rounds > 1 else ''} ...",
                  file=log, flush=True)
            try:
                runs[i].append(run_server(servers[i], str(path), hf_dir, profile, dtype, threads, prompts, log,
                                          replicas))
            except NotRunnable as e:
                rows[i].not_run = str(e) if rounds == 1 else f"{e} (round {n + 1} of {rounds})"
    for row, server_runs in zip(rows, runs):
        if not row.not_run:
            measured(row, server_runs, profile, prompts.ids)
    add_comparisons(rows)
    return rows


@dataclass(frozen=True)
class Run:
    """One server's start and load: what a row is made of."""

    load_s: float
    peak_bytes: int
    load: Load
    server: Server


def run_server(spec: str, model: str, hf_dir: Path | None, profile: ServingProfile, dtype: str, threads: int,
               prompts: Prompts, log: Any, replicas: int = 1) -> Run:
    """Start the server, send it the load, stop it. Raises NotRunnable with the reason where it did not run
    (a request that failed: "failed: ...")."""
    port = free_port()
    server = make_server(spec, model, hf_dir, port, profile.positions, profile.concurrency, profile.requests,
                         profile.new_tokens, dtype, threads, replicas, prompts.response_format)
    running = Running(server, port)
    try:
        running.wait_ready()
        warm_up, sent = prompts.sent(server.token_ids)
        run_load(running.url, server.model, [warm_up], 1, 1, server.body, server.api)  # a compiled server compiles here
        load_s = running.elapsed()
        print(f"linnet bench-serve: {spec} ready in {load_s:.1f} s; {profile.describe()}", file=log, flush=True)
        load = run_load(running.url, server.model, sent, profile.new_tokens, profile.concurrency, server.body,
                        server.api, prompts.follows)
    except ServingError as e:
        raise NotRunnable(f"failed: {e}") from None
    finally:
        running.stop()
    return Run(load_s, running.peak_bytes, load, server)


def measured(row: Row, runs: list[Run], profile: ServingProfile, prompts: list[list[int]]) -> None:
    """The row's metrics and notes from its runs (one a round)."""
    several = len(runs) > 1
    tok_s = [r.load.completion_tokens / r.load.wall_s for r in runs]
    load_s = [r.load_s for r in runs]
    timings = [t for r in runs for t in r.load.timings]
    ttft_ms = [t.first_token_s * 1000 for t in timings]
    gaps_ms = [g * 1000 for t in timings for g in t.chunk_gaps_s]
    row.metrics = {"serve_tok_s": Metric(statistics.median(tok_s), tok_s if several else None),
                   "serve_ttft_ms": Metric(statistics.median(ttft_ms), ttft_ms),
                   "load_s": Metric(statistics.median(load_s), load_s if several else None),
                   "peak_mem_gib": Metric(max(r.peak_bytes for r in runs) / 2**30)}
    row.memory_is_setting = runs[0].server.memory_is_setting
    p99s = [percentile([t.first_token_s * 1000 for t in r.load.timings], 99) for r in runs]
    rounds = [f"{len(runs)} rounds (the servers' order reversed every other round): throughput the median "
              f"over rounds of {', '.join(f'{x:.1f}' for x in tok_s)} tok/s; first tokens and gaps over every "
              f"round's requests (time to first token p99 by round: {', '.join(f'{x:.0f}' for x in p99s)} ms)"
              ] if several else []
    row.notes = [profile.describe(), *runs[0].server.notes, *rounds,
                 f"time to first token: mean {statistics.mean(ttft_ms):.0f} ms, p50 {percentile(ttft_ms, 50):.0f} ms, "
                 f"p99 {percentile(ttft_ms, 99):.0f} ms",
                 f"inter-token latency (gaps between streamed chunks): p50 {percentile(gaps_ms, 50):.1f} ms, "
                 f"p99 {percentile(gaps_ms, 99):.1f} ms",
                 *dict.fromkeys(note for r in runs for note in token_notes(r.load.timings, profile, prompts)),
                 *recomputed_notes(runs)]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def token_notes(timings: list[Any], profile: ServingProfile, prompts: list[list[int]]) -> list[str]:
    """The tokens returned, as the server counted them; and where it tokenized the prompts differently."""
    returned = sum(t.completion_tokens for t in timings)
    asked = f"{profile.requests} x {profile.new_tokens}"
    notes = [f"{returned} tokens returned ({asked})" if returned == profile.requests * profile.new_tokens
             else f"returned {returned} tokens, not {asked}"]
    counted, sent = sum(t.prompt_tokens for t in timings), sum(len(p) for p in prompts)
    if counted != sent:
        notes.append(f"counted {counted} prompt tokens where the others got {sent} ({counted / sent - 1:+.1%})")
    return notes


def recomputed_notes(runs: list[Run]) -> list[str]:
    """The prompt tokens the server computed (its prompt tokens less those it found cached), a round's load
    at a time, where it says what it found cached: what prefix caching and prefix-aware routing save."""
    counts = []
    for r in runs:
        if any(t.cached_tokens is None for t in r.load.timings):
            return []
        prompt = sum(t.prompt_tokens for t in r.load.timings)
        counts.append((prompt - sum(t.cached_tokens or 0 for t in r.load.timings), prompt))
    return ["prompt tokens recomputed (not found cached): "
            + ", ".join(f"{done} of {prompt} ({done / prompt:.0%})" for done, prompt in counts)
            + (" by round" if len(counts) > 1 else "")] if counts else []


def add_comparisons(rows: list[Row]) -> None:
    """Each Linnet row against vLLM's throughput, or transformers' where vLLM did not run; a Triton or Ray
    Serve row against `linnet serve` on the same backend, and a JSON-schema row against the same server
    unconstrained, where those ran: what hosting the engine, or constraining its output, costs."""
    ran = {r.id: r for r in rows if not r.not_run}
    peer = ran.get("vllm:serve") or ran.get("transformers:serve")
    for row in rows:
        if not row.linnet or row.id not in ran:
            continue
        # a constrained or speculating row against the same server only: against another engine it says nothing
        other = ran.get(same_run_baseline(row.id)) or (None if row.id.startswith((JSON_ROWS, SPECULATIVE_ROWS))
                                                        else peer)
        if other is not None:
            ratio = row.measured("serve_tok_s") / other.measured("serve_tok_s")
            row.against = Against(other.id, "serve_tok_s", round(ratio, 3))
            mine, theirs = row.metrics["serve_tok_s"].samples, other.metrics["serve_tok_s"].samples
            if mine and theirs:  # several rounds: the ratio within each round too
                row.notes.append(f"throughput against {other.id} round by round: "
                                 + ", ".join(f"{a / b:.2f}x" for a, b in zip(mine, theirs)))


def same_run_baseline(row_id: str) -> str:
    """The id of the row a row is measured against in the same run; "" for linnet serve alone (a peer)."""
    for variant in (JSON_ROWS, SPECULATIVE_ROWS, ROUND_ROBIN_ROWS):  # the same server otherwise
        if row_id.startswith(variant):
            return row_id.removeprefix(variant)
    for hosted in (TRITON_ROWS, RAY_ROWS):
        if row_id.startswith(hosted):
            return "serve:" + row_id.removeprefix(hosted)
    return ""


def serving_results(model: str, model_id: str, servers: list[str], profile: ServingProfile, dtype: str,
                    threads: int | None, log: Any = sys.stderr, rounds: int = 1, replicas: int = 1) -> Results:
    """``serving_rows`` as a whole results file, with the machine, the load average and the profile."""
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load_average = [round(x, 2) for x in os.getloadavg()]
    rows = serving_rows(model, servers, profile, dtype, threads, log, rounds, replicas)
    env = importable_here(worker_environment(threads or machine.cores(), "inherit"))
    gflop_s = arithmetic.measure_apart(env, dtype, log)
    arithmetic.add_notes(rows, open_spec(str(resolve(model))), statistics.median(gflop_s), dtype)
    protocol = Protocol(prompt_tokens=profile.longest_prompt, new_tokens=profile.new_tokens, batch=profile.concurrency,
                        runs=rounds, warmups=1, serving=profile.serving())
    return Results(model=model_id, timestamp=started,
                   machine=Machine(accelerator=None, cpu=machine.cpu(),
                                   memory_gib=machine.memory_gib(), threads=threads or machine.cores(),
                                   load_average=load_average,
                                   matmul_gflop_s=Metric(statistics.median(gflop_s), gflop_s)),
                   versions=machine.versions(), protocol=protocol, rows=rows)


def format_serving(results: Results, profile: ServingProfile) -> str:
    m = results.machine
    lines = [f"{results.model} · profile {profile.name}: {profile.describe()} · {results.timestamp}",
             f"{m.cpu} · {m.memory_gib} GiB · {m.threads} threads · load average "
             f"{' '.join(f'{x:.2f}' for x in m.load_average or [])} at the start{arithmetic.measured(m)}", ""]
    lines += serving_table(results.rows)
    lines += ["", "Notes:"] + [f"  {r.name}: {'; '.join(r.notes)}" for r in results.rows if r.notes]
    return "\n".join(lines)


def serving_table(rows: list[Row]) -> list[str]:
    """The serving rows as a table, then those not run with their reasons."""
    table = [("Server", "Throughput", "Arithmetic", "TTFT p50", "TTFT p99", "Load", "Peak memory",
              "Against (same run)")]
    for r in rows:
        if r.not_run:
            continue
        ttft = r.metrics["serve_ttft_ms"].samples or []
        table.append((r.name, f"{r.value('serve_tok_s'):.1f} tok/s", arithmetic.share(r),
                      f"{percentile(ttft, 50):.0f} ms", f"{percentile(ttft, 99):.0f} ms", f"{r.value('load_s'):.1f} s",
                      f"{r.value('peak_mem_gib'):.2f} GiB",
                      f"{r.against.ratio:.2f}x {r.against.row}" if r.against else ""))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    return lines + [f"{r.name}: not run: {r.not_run}" for r in rows if r.not_run]
