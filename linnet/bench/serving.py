"""The serving benchmark: servers (OpenAI-compatible ones, and Triton hosting linnet.serve), each started and
stopped in turn, driven over HTTP by N requests of random prompt lengths and fixed new tokens, at most C in
flight, timed at the client.

Every server gets the same prompts (token ids drawn with a fixed seed) and must return exactly
``new_tokens`` tokens for each (greedy, the end-of-sequence token ignored). A row's ``serve_tok_s`` is all
completion tokens over the wall time of the whole load; ``serve_ttft_ms`` the median time to first token,
its samples one per request; ``load_s`` from starting the server to its answering a first one-token request;
``peak_mem_gib`` the largest resident memory of the server's processes, sampled while it ran.
"""
from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from linnet.bench import arithmetic, machine
from linnet.bench.harness import importable_here, worker_environment
from linnet.bench.serving_client import ServingError, run_load
from linnet.bench.serving_servers import TRITON_ROWS, NotRunnable, Running, free_port, make_server, server_ids
from linnet.errors import LinnetError
from linnet.model import open_model, open_spec, resolve
from linnet.registry.schema import Protocol, Serving
from linnet.results import SERVING_GROUP, Against, Machine, Metric, Results, Row

PROMPT_SEED = 0


@dataclass(frozen=True)
class ServingProfile:
    name: str
    requests: int
    prompt_min: int
    prompt_max: int
    new_tokens: int
    concurrency: int  # requests in flight at most: the servers' rows

    @property
    def positions(self) -> int:
        return self.prompt_max + self.new_tokens

    def serving(self) -> Serving:
        return Serving(self.requests, self.prompt_min, self.prompt_max, self.new_tokens, self.concurrency)

    def describe(self) -> str:
        return (f"{self.requests} requests of {self.prompt_min}-{self.prompt_max} prompt tokens and "
                f"{self.new_tokens} new tokens, at most {self.concurrency} in flight")


PROFILES = {p.name: p for p in (
    ServingProfile("seed", 256, 128, 512, 128, 64),  # the published pages' protocol
    ServingProfile("cpu-prompt", 64, 128, 512, 64, 16),  # prompt-heavy, sized for a CPU
    ServingProfile("cpu-decode", 64, 32, 128, 128, 16),  # decode-heavy
)}


def random_prompts(vocab_size: int, profile: ServingProfile, seed: int = PROMPT_SEED) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(profile.prompt_min, profile.prompt_max + 1, profile.requests)
    return [rng.integers(0, vocab_size, n).tolist() for n in lengths]


def serving_rows(model: str, servers: list[str], profile: ServingProfile, dtype: str, threads: int | None,
                 log: Any = sys.stderr) -> list[Row]:
    """One row per server, in the order given; a server that cannot run is a row "not run: reason"."""
    path = resolve(model)
    loaded = open_model(str(path))
    if loaded.tokenizer is None:
        raise LinnetError(f"{path} has no tokenizer.json; linnet serve and the peers' text prompts need one")
    hf_dir = path if path.is_dir() else None
    prompts = random_prompts(loaded.spec.vocab_size, profile)
    texts = [loaded.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    threads = threads or machine.cores()
    rows = []
    for spec in servers:
        print(f"linnet bench-serve: {spec} ...", file=log, flush=True)
        rows.append(serve_one(spec, str(path), hf_dir, profile, dtype, threads, prompts, texts, log))
    add_comparisons(rows)
    return rows


def serve_one(spec: str, model: str, hf_dir: Path | None, profile: ServingProfile, dtype: str, threads: int,
              prompts: list[list[int]], texts: list[str], log: Any) -> Row:
    try:
        row_id, name, linnet = server_ids(spec)
    except NotRunnable as e:
        return Row(spec, SERVING_GROUP, spec, not_run=str(e))
    row = Row(row_id, SERVING_GROUP, name, linnet=linnet)
    port = free_port()
    try:
        server = make_server(spec, model, hf_dir, port, profile.positions, profile.concurrency, profile.requests,
                             profile.new_tokens, dtype, threads)
    except NotRunnable as e:
        row.not_run = str(e)
        return row
    running = Running(server, port)
    try:
        running.wait_ready()
        sent = prompts if server.token_ids else texts
        run_load(running.url, server.model, sent[:1], 1, 1, server.body, server.api)  # a compiled server compiles here
        load_s = running.elapsed()
        print(f"linnet bench-serve: {spec} ready in {load_s:.1f} s; {profile.describe()}", file=log, flush=True)
        load = run_load(running.url, server.model, sent, profile.new_tokens, profile.concurrency, server.body,
                        server.api)
    except (NotRunnable, ServingError) as e:
        row.not_run = f"failed: {e}" if isinstance(e, ServingError) else str(e)
        return row
    finally:
        running.stop()
    ttft_ms = [t.first_token_s * 1000 for t in load.timings]
    gaps_ms = [g * 1000 for t in load.timings for g in t.chunk_gaps_s]
    row.metrics = {"serve_tok_s": Metric(load.completion_tokens / load.wall_s),
                   "serve_ttft_ms": Metric(statistics.median(ttft_ms), ttft_ms),
                   "load_s": Metric(load_s),
                   "peak_mem_gib": Metric(running.peak_bytes / 2**30)}
    row.memory_is_setting = server.memory_is_setting
    row.notes = [profile.describe(), *server.notes,
                 f"time to first token: mean {statistics.mean(ttft_ms):.0f} ms, p50 {percentile(ttft_ms, 50):.0f} ms, "
                 f"p99 {percentile(ttft_ms, 99):.0f} ms",
                 f"inter-token latency (gaps between streamed chunks): p50 {percentile(gaps_ms, 50):.1f} ms, "
                 f"p99 {percentile(gaps_ms, 99):.1f} ms",
                 *token_notes(load.timings, profile, prompts)]
    return row


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


def add_comparisons(rows: list[Row]) -> None:
    """Each Linnet row against vLLM's throughput, or transformers' where vLLM did not run; a Triton row against
    `linnet serve` on the same backend, where that ran: what hosting the engine in Triton costs."""
    ran = {r.id: r for r in rows if not r.not_run}
    peer = ran.get("vllm:serve") or ran.get("transformers:serve")
    for row in rows:
        if not row.linnet or row.id not in ran:
            continue
        hosted = row.id.startswith(TRITON_ROWS)
        other = (ran.get("serve:" + row.id.removeprefix(TRITON_ROWS)) if hosted else None) or peer
        if other is not None:
            ratio = row.value("serve_tok_s") / other.value("serve_tok_s")
            row.against = Against(other.id, "serve_tok_s", round(ratio, 3))


def serving_results(model: str, model_id: str, servers: list[str], profile: ServingProfile, dtype: str,
                    threads: int | None, log: Any = sys.stderr) -> Results:
    """``serving_rows`` as a whole results file, with the machine, the load average and the profile."""
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    load_average = [round(x, 2) for x in os.getloadavg()]
    rows = serving_rows(model, servers, profile, dtype, threads, log)
    env = importable_here(worker_environment(threads or machine.cores(), "inherit"))
    gflop_s = arithmetic.measure_apart(env, dtype, log)
    arithmetic.add_notes(rows, open_spec(str(resolve(model))), statistics.median(gflop_s), dtype)
    protocol = Protocol(prompt_tokens=profile.prompt_max, new_tokens=profile.new_tokens, batch=profile.concurrency,
                        runs=1, warmups=1, serving=profile.serving())
    return Results(model=model_id, timestamp=started,
                   machine=Machine(accelerator=None, cpu=f"{machine.cpu_model()}, {machine.cores()} cores",
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
        table.append((r.name, f"{r.value('serve_tok_s'):.1f} tok/s", arithmetic.share(r), f"{percentile(ttft, 50):.0f} ms",
                      f"{percentile(ttft, 99):.0f} ms", f"{r.value('load_s'):.1f} s",
                      f"{r.value('peak_mem_gib'):.2f} GiB",
                      f"{r.against.ratio:.2f}x {r.against.row}" if r.against else ""))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    return lines + [f"{r.name}: not run: {r.not_run}" for r in rows if r.not_run]
