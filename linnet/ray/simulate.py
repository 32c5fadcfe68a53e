"""A simulation of routing a chat service's requests over replicas: prefix-aware against round-robin and
least-loaded, on a synthetic trace. ``python -m linnet.ray.simulate`` prints the table docs/SCALE.md shows.

The trace: conversations, each opening with one of a few shared system prompts, then turns of a user
message and an answer; each turn's prompt is the whole conversation so far. Conversations arrive at
random (Poisson), and a turn comes a think time after the last answer ended.

A replica is ``linnet serve``'s engine, modelled: ``rows`` cache rows, a request takes a free row (the one
holding the longest prefix of its prompt, as ``Engine._pick_row``; the least recently freed where none
does) or waits for one; it costs ``prefill_ms`` a prompt token it must compute, then ``decode_ms`` a
token of its answer; a freed row keeps what it wrote. The router (``linnet.ray.router``) sees what Ray
Serve's router sees: each replica's queue length and what it sent where.

Prompt tokens are 4-character words so that the router's character blocks (64) are 16-token blocks, and
a row's match is found on the same chained block hashes, then extended token by token.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from linnet.ray.router import BLOCK_CHARS, BUSY_MARGIN, PrefixRecord, choose, prefix_blocks

CHARS = 4  # characters a token is written as
BLOCK_TOKENS = BLOCK_CHARS // CHARS
POLICIES = ("prefix-aware", "round-robin", "least-loaded")


@dataclass
class Turn:
    prompt: list[int]
    blocks: list[bytes]  # the prompt's chained block hashes, as the router makes them
    answer: int  # tokens of the answer
    held: list[int] = field(default_factory=list)  # what a row holds after this turn: prompt and answer
    held_blocks: list[bytes] = field(default_factory=list)


@dataclass
class Conversation:
    start: float
    turns: list[Turn]
    think: list[float]  # seconds between an answer and the next turn


@dataclass
class TraceShape:
    system_prompts: int = 16
    system_tokens: tuple[int, int] = (200, 800)
    turns: tuple[int, int] = (2, 8)
    user_tokens: tuple[int, int] = (20, 150)
    answer_tokens: tuple[int, int] = (30, 250)
    think_s: float = 10.0


@dataclass
class Costs:
    prefill_ms: float = 0.5  # a prompt token computed (a few thousand tokens/s on a CPU replica)
    decode_ms: float = 20.0  # a token generated, per request


def text(tokens: Sequence[int]) -> str:
    return "".join(f"{t:04x}" for t in tokens)


def make_trace(conversations: int, rate: float, shape: TraceShape, seed: int) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    next_token = itertools.count(1)

    def fresh(n: int) -> list[int]:  # distinct content: each message its own tokens
        return [next(next_token) % 65536 for _ in range(n)]

    systems = [fresh(int(rng.integers(*shape.system_tokens))) for _ in range(shape.system_prompts)]
    popularity = 1 / np.arange(1, shape.system_prompts + 1)  # Zipf: a few system prompts serve most chats
    popularity /= popularity.sum()
    out, clock = [], 0.0
    for _ in range(conversations):
        clock += rng.exponential(1 / rate)
        so_far = list(systems[rng.choice(shape.system_prompts, p=popularity)])
        turns = []
        for _ in range(int(rng.integers(shape.turns[0], shape.turns[1] + 1))):
            so_far += fresh(int(rng.integers(*shape.user_tokens)))
            prompt = list(so_far)
            answer = fresh(int(rng.integers(*shape.answer_tokens)))
            so_far += answer
            held = prompt + answer[:-1]  # the last token is sampled, never written
            turns.append(Turn(prompt, prefix_blocks(text(prompt), max_blocks=10**9), len(answer), held,
                              prefix_blocks(text(held), max_blocks=10**9)))
        out.append(Conversation(clock, turns, list(rng.exponential(shape.think_s, len(turns)))))
    return out


def common_blocks(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """Leading blocks two chained-hash lists share (equal at i means equal before)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[middle - 1] == b[middle - 1]:
            low = middle
        else:
            high = middle - 1
    return low


def cached_tokens(held: Turn, turn: Turn) -> int:
    """Tokens of ``turn``'s prompt a row holding ``held.held`` can keep (all but the prompt's last)."""
    n = common_blocks(held.held_blocks, turn.blocks) * BLOCK_TOKENS
    limit = min(len(held.held), len(turn.prompt) - 1)
    while n < limit and held.held[n] == turn.prompt[n]:
        n += 1
    return min(n, limit)


class Replica:
    def __init__(self, rows: int):
        self.rows: list[Turn | None] = [None] * rows  # what each free row holds
        self.free_since = [0.0] * rows
        self.busy: set[int] = set()
        self.waiting: list[tuple[float, Turn, Callable[[float], None]]] = []

    @property
    def load(self) -> int:
        return len(self.busy) + len(self.waiting)

    def take_row(self, turn: Turn) -> tuple[int, int]:
        """The free row with the longest usable prefix of ``turn``'s prompt (the least recently freed when
        none has any), and that prefix's length."""
        best, best_n = -1, -1
        for row, held in enumerate(self.rows):
            if row in self.busy:
                continue
            n = cached_tokens(held, turn) if held is not None else 0
            if n > best_n or (n == best_n == 0 and self.free_since[row] < self.free_since[best]):
                best, best_n = row, n
        self.busy.add(best)
        return best, best_n


@dataclass
class Result:
    policy: str
    replicas: int
    requests: int = 0
    prompt_tokens: int = 0
    cached: int = 0
    ttft: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.cached / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def recomputed(self) -> int:
        return self.prompt_tokens - self.cached


def simulate(trace: list[Conversation], replicas: int, rows: int, policy: str, costs: Costs,
             record_blocks: int, seed: int = 0) -> Result:
    """Run ``trace`` over ``replicas`` replicas of ``rows`` rows, routed by ``policy``."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    rng = random.Random(seed)
    pool = [Replica(rows) for _ in range(replicas)]
    records = {i: PrefixRecord(record_blocks) for i in range(replicas)}
    turn_robin = itertools.count()
    result = Result(policy, replicas)
    events: list[tuple[float, int, Callable[[float], None]]] = []
    order = itertools.count()

    def at(time: float, action: Callable[[float], None]) -> None:
        heapq.heappush(events, (time, next(order), action))

    def route(turn: Turn) -> int:
        if policy == "round-robin":
            return next(turn_robin) % replicas
        loads = {i: r.load for i, r in enumerate(pool)}
        if policy == "least-loaded":
            least = min(loads.values())
            return rng.choice([i for i, n in loads.items() if n == least])
        chosen = choose(turn.blocks, loads, records, BUSY_MARGIN)[0]
        records[chosen].add(turn.blocks)
        return chosen

    def admit(now: float, replica: Replica, arrived: float, turn: Turn, then: Callable[[float], None]) -> None:
        row, cached = replica.take_row(turn)
        result.requests += 1
        result.prompt_tokens += len(turn.prompt)
        result.cached += cached
        first_token = now + (len(turn.prompt) - cached) * costs.prefill_ms / 1000
        result.ttft.append(first_token - arrived)
        done = first_token + turn.answer * costs.decode_ms / 1000

        def finish(t: float) -> None:
            replica.busy.discard(row)
            replica.rows[row], replica.free_since[row] = turn, t
            if replica.waiting:
                arrived_w, turn_w, then_w = replica.waiting.pop(0)
                admit(t, replica, arrived_w, turn_w, then_w)
            then(t)

        at(done, finish)

    def arrive(conversation: Conversation, index: int) -> Callable[[float], None]:
        def go(now: float) -> None:
            turn = conversation.turns[index]
            replica = pool[route(turn)]

            def then(t: float) -> None:
                if index + 1 < len(conversation.turns):
                    at(t + conversation.think[index], arrive(conversation, index + 1))

            if len(replica.busy) < len(replica.rows):
                admit(now, replica, now, turn, then)
            else:
                replica.waiting.append((now, turn, then))
        return go

    for conversation in trace:
        at(conversation.start, arrive(conversation, 0))
    while events:
        time, _, action = heapq.heappop(events)
        action(time)
    return result


def run(replica_counts: Sequence[int], per_replica: int, rows: int, load: float, shape: TraceShape, costs: Costs,
        seed: int) -> list[Result]:
    """Each replica count with its own trace of ``per_replica`` conversations a replica, arriving at the rate
    that keeps about ``load`` of its rows busy (Little's law on the trace's own means)."""
    turns = (shape.turns[0] + shape.turns[1]) / 2
    service = (np.mean(shape.system_tokens) * costs.prefill_ms / 1000  # a whole prompt at worst, roughly
               + np.mean(shape.answer_tokens) * costs.decode_ms / 1000)
    busy_fraction = service / (service + shape.think_s)
    lifetime = turns * (service + shape.think_s)
    results = []
    for replicas in replica_counts:
        rate = float(load * rows * replicas / busy_fraction / lifetime)  # conversations a second
        trace = make_trace(per_replica * replicas, rate, shape, seed)
        longest = shape.system_tokens[1] + shape.turns[1] * (shape.user_tokens[1] + shape.answer_tokens[1])
        record_blocks = rows * longest // BLOCK_TOKENS  # the router remembers about what the rows can hold
        for policy in POLICIES:
            results.append(simulate(trace, replicas, rows, policy, costs, record_blocks, seed))
    return results


def table(results: Sequence[Result]) -> str:
    lines = ["| replicas | policy | requests | prompt tokens | cache hit rate | recomputed | vs round-robin "
             "| TTFT p50 ms | TTFT p99 ms |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    robin = {r.replicas: r.recomputed for r in results if r.policy == "round-robin"}
    for r in results:
        p50, p99 = np.percentile(r.ttft, [50, 99]) * 1000
        lines.append(f"| {r.replicas} | {r.policy} | {r.requests} | {r.prompt_tokens} | {r.hit_rate:.1%} | "
                     f"{r.recomputed} | {r.recomputed / robin[r.replicas]:.2f}x | {p50:.0f} | {p99:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linnet.ray.simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--conversations-per-replica", type=int, default=100)
    parser.add_argument("--rows", type=int, default=8, help="cache rows a replica (its bounded prefix cache)")
    parser.add_argument("--load", type=float, default=0.7, help="the fraction of rows busy the arrival rate aims at")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.replicas) < 1 or args.rows < 1 or args.conversations_per_replica < 1 or not 0 < args.load:
        parser.error("replicas, rows and conversations must be at least 1, and load more than 0")
    shape, costs = TraceShape(), Costs()
    results = run(args.replicas, args.conversations_per_replica, args.rows, args.load, shape, costs, args.seed)
    print(f"{args.conversations_per_replica} conversations a replica, {args.rows} rows a replica, load {args.load}, "
          f"seed {args.seed}; {shape}; {costs}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
