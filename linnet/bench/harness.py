"""The parent: one worker process per subject, then the distances, the ratios and a ``Results``.

Each subject runs in its own process so that one's memory, threads and compiled state never
contaminate another's. By default the subjects take turns, one generation each (after every worker
has loaded): on a shared machine whose memory bandwidth drifts over minutes, each ratio then compares
generations run minutes apart at most, not one subject's whole series against another's. The load
average is read before and after each subject's runs, since any other busy process changes every figure.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from linnet import openmp
from linnet.bench import bandwidth, machine
from linnet.bench.protocol import PEERS, REFERENCE, Job, empty_row, random_prompt
from linnet.errors import LinnetError
from linnet.model import open_spec, resolve
from linnet.registry.schema import Protocol
from linnet.results import Against, Machine, Metric, Results, Row

OMP_WAIT_POLICIES = (*openmp.POLICIES, "inherit")


@dataclass(frozen=True)
class Settings:
    model: str  # a path or registry name
    subjects: tuple[str, ...]  # registry backend ids and peers, in any order; the reference runs first
    protocol: Protocol
    dtype: str = "f32"
    threads: int | None = None  # None: every core this process may use
    omp_wait_policy: str = openmp.DEFAULT  # a policy of linnet.openmp, or "inherit" the caller's
    interleave: bool = True  # subjects take turns, one generation each; False: one subject after another


def run_bench(settings: Settings, log: Any = sys.stderr) -> Results:
    path = resolve(settings.model)
    spec = open_spec(str(path))  # the parent never loads the weights its workers measure
    threads = settings.threads or machine.cores()
    env = worker_environment(threads, settings.omp_wait_policy)
    if settings.interleave and env.get("OMP_WAIT_POLICY", "").upper() == "ACTIVE":
        raise LinnetError("interleaved runs need idle workers whose threads sleep: with OMP_WAIT_POLICY=ACTIVE "
                          "they spin for minutes on the cores the running worker needs; "
                          "run them in sequence (--sequential)")
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load_average = [round(x, 2) for x in os.getloadavg()]
    order = sorted(settings.subjects, key=lambda s: s != REFERENCE)  # stable: the reference first
    with tempfile.TemporaryDirectory(prefix="linnet-bench-") as tmp:
        job = Job(str(path), settings.dtype, settings.protocol,
                  random_prompt(spec.vocab_size, settings.protocol.prompt_tokens), tmp)
        job_path = Path(tmp) / "job.json"
        job.save(job_path)
        reports: dict[str, dict[str, Any]] = {}
        for subject in order:
            # An untimed load first, in a process of its own: the page cache then holds the checkpoint and
            # Linnet's converted weights exist, so every load time is the steady state, not the first one's.
            print(f"linnet bench: preparing {subject} ...", file=log, flush=True)
            primed = prime(job_path, subject, env)
            if "not_run" in primed:
                reports[subject] = primed
        ready = [s for s in order if s not in reports]
        print("linnet bench: measuring the read bandwidth before the turns and after each ...", file=log, flush=True)
        sampler = bandwidth.TurnSampler(importable_here(env))  # it drifts: sampled as the runs go
        try:
            read_gb_s = sampler.sample()

            def between() -> None:
                read_gb_s.extend(sampler.sample())

            for turn in ([ready] if settings.interleave else [[s] for s in ready]):
                reports.update(run_turns(job_path, turn, env, settings.protocol, log, between=between))
        finally:
            sampler.close()
        distances = {s: distance_from_reference(job, s, reports) for s in order
                     if s != REFERENCE and "not_run" not in reports[s]}
        reads = bandwidth.reads_of_subjects(job, spec, reports)
    rows = [make_row(s, reports[s], distances.get(s), settings.interleave and len(ready) > 1) for s in order]
    add_comparisons(rows)
    bandwidth.add_notes(rows, reads, statistics.median(read_gb_s))
    accelerator = next((r["accelerator"] for r in reports.values() if r.get("accelerator")), None)
    return Results(
        model=settings.model if not Path(settings.model).exists() else path.resolve().name,
        timestamp=started,
        machine=Machine(accelerator=accelerator, cpu=machine.cpu(),
                        memory_gib=machine.memory_gib(), threads=threads, load_average=load_average,
                        read_gb_s=_metric(read_gb_s)),
        versions=machine.versions(),
        protocol=settings.protocol,
        rows=rows,
    )


def worker_environment(threads: int, omp_wait_policy: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return openmp.policy_environment(env, omp_wait_policy)


def worker_command(*args: str) -> list[str]:
    """``python -P -m linnet.bench.worker ...``: ``-P`` keeps the current directory off the worker's path, so
    that a folder there named ``linnet`` (a clone, say) never stands in for the Linnet this process runs."""
    return [sys.executable, "-P", "-m", "linnet.bench.worker", *args]


def importable_here(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this process's Linnet first on PYTHONPATH: the workers import the very same one, whether
    it is installed or, run from a source tree, found only through the current directory."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding this linnet package
    return {**env, "PYTHONPATH": os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])}


class Worker:
    """A subject's worker process (``linnet.bench.worker``), driven one line at a time.

    Each worker has a session of its own, so a Ctrl-C in the terminal reaches the parent alone, which then
    ends its workers (``close``) instead of each printing its own traceback. With a ``time_limit``, a worker
    still running after that many seconds is killed with whatever it started, and reports that it was.
    """

    def __init__(self, job: Path, subject: str, env: dict[str, str], load_only: bool = False,
                 time_limit: float | None = None):
        flags = ["--load-only"] if load_only else []
        self.process = subprocess.Popen(worker_command(str(job), subject, *flags), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=importable_here(env),
                                        start_new_session=True)
        assert self.process.stdin is not None and self.process.stdout is not None  # both piped
        self.stdin, self.stdout = self.process.stdin, self.process.stdout
        self.time_limit, self.expired = time_limit, False
        self.timer = None if time_limit is None else threading.Timer(max(time_limit, 0), self._expire)
        if self.timer:
            self.timer.daemon = True
            self.timer.start()

    def _expire(self) -> None:
        if self.process.poll() is None:
            self.expired = True
            os.killpg(self.process.pid, signal.SIGKILL)  # its session: the worker and anything it started

    def receive(self) -> dict[str, Any]:
        """The worker's next message; anything else it printed goes to stderr, not lost."""
        for line in self.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                message = None
            if isinstance(message, dict):
                return message
            sys.stderr.write(line)
        status = self.process.wait()
        if self.expired:
            return {"not_run": f"time limit of {self.time_limit:g} s"}
        return {"not_run": f"failed: the worker exited with status {status} and no report"}

    def ask(self, command: str) -> dict[str, Any]:
        try:
            self.stdin.write(command + "\n")
            self.stdin.flush()
        except BrokenPipeError:
            pass  # it has exited: receive() says so
        return self.receive()

    def close(self) -> None:
        try:
            self.stdin.close()
        except BrokenPipeError:
            pass  # killed at its time limit
        self.process.wait()
        if self.timer:
            self.timer.cancel()

    def kill(self) -> None:
        if self.timer:
            self.timer.cancel()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def prime(job_path: Path, subject: str, env: dict[str, str], time_limit: float | None = None) -> dict[str, Any]:
    """An untimed load of ``subject`` in a process of its own (caches filled, exports written, code
    compiled): its reply, which says "not_run" where the subject cannot run."""
    primer = Worker(job_path, subject, env, load_only=True, time_limit=time_limit)
    try:
        primed = primer.receive()
    except BaseException:  # Ctrl-C: it must not outlive the bench
        primer.kill()
        raise
    primer.close()
    return primed


def run_turns(job: Path, subjects: list[str], env: dict[str, str], protocol: Protocol, log: Any,
              time_limit: float | None = None, between: Callable[[], None] | None = None
              ) -> dict[str, dict[str, Any]]:
    """Load every subject in its worker, then run the warm-ups and runs, the subjects taking turns; a worker
    not done within ``time_limit`` seconds is stopped, and its report says so. ``between`` is called after
    each round of timed runs (the bench samples the read bandwidth there)."""
    workers: dict[str, Worker] = {}
    try:
        for s in subjects:
            workers[s] = Worker(job, s, env, time_limit=time_limit)
        return _take_turns(workers, protocol, log, between)
    except BaseException:  # Ctrl-C or a failure: no worker is left running
        for w in workers.values():
            w.kill()
        raise


def _take_turns(workers: dict[str, Worker], protocol: Protocol, log: Any,
                between: Callable[[], None] | None = None) -> dict[str, dict[str, Any]]:
    subjects = list(workers)
    reports = {s: {**w.receive(), "started": [], "ttft_s": [], "decode_tok_s": []} for s, w in workers.items()}
    live = [s for s in subjects if "not_run" not in reports[s]]
    for s in live:
        reports[s]["load_average"] = [round(os.getloadavg()[0], 2)]
    for i in range(protocol.warmups + protocol.runs):
        warm_up = " (warm-up)" if i < protocol.warmups else ""
        print(f"linnet bench: generation {i + 1} of {protocol.warmups + protocol.runs}{warm_up}: "
              f"{', '.join(live)}", file=log, flush=True)
        for s in list(live):
            sample = workers[s].ask("run")
            if "not_run" in sample:
                reports[s].update(sample)
                live.remove(s)
                continue
            reports[s]["started"].append(sample["started"])
            if i >= protocol.warmups:
                reports[s]["ttft_s"].append(sample.pop("ttft_s"))
                reports[s]["decode_tok_s"].append(sample.pop("decode_tok_s"))
            if i == 0:
                reports[s].update(first_generation_s=sample["first_generation_s"], tokens=sample["tokens"])
        if between is not None and i >= protocol.warmups:
            between()
    for s in live:
        reports[s].update(workers[s].ask("done"))
        reports[s]["load_average"].append(round(os.getloadavg()[0], 2))
    for w in workers.values():
        w.close()
    return reports


def distance_from_reference(job: Job, subject: str, reports: dict[str, dict], reference: Job | None = None
                            ) -> tuple[float, int] | None:
    """Largest |logit difference| from the reference, and over how many steps, or None without one.
    ``reference``: the job the reference ran in, when not ``job`` (another dtype's, say).

    Step 0 is the prompt's last position; step i follows the first i generated tokens, so once the two
    chose different tokens, later steps have different inputs and are not compared.
    """
    ref = reports.get(REFERENCE)
    if ref is None or "not_run" in ref:
        return None
    mine, theirs = np.load(job.logits_path(subject)), np.load((reference or job).logits_path(REFERENCE))
    a, b = reports[subject]["tokens"], ref["tokens"]
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    steps = min(same + 1, len(mine), len(theirs))
    return float(np.max(np.abs(mine[:steps] - theirs[:steps]))), steps


def make_row(subject: str, r: dict[str, Any], distance: tuple[float, int] | None, interleaved: bool) -> Row:
    row = empty_row(subject)
    if "not_run" in r:
        row.not_run = r["not_run"]
        return row
    row.metrics = {
        "ttft_ms": _metric([t * 1000 for t in r["ttft_s"]]),
        "decode_tok_s": _metric(r["decode_tok_s"]),
        "load_s": _metric([r["load_s"]]),
        "peak_mem_gib": _metric([r["peak_memory"] / 2**30]),
    }
    before, after = r["load_average"]
    row.notes = [
        *r["notes"],
        f"{r['threads']} thread{'s' * (r['threads'] != 1)}, {r['openmp']}",
        f"load average {before:.2f} before, {after:.2f} after",
        f"first generation {r['first_generation_s']:.3g} s",
        "runs interleaved with the other subjects'" if interleaved else "runs apart from the other subjects'",
    ]
    if subject == REFERENCE:
        row.distance = "reference"
    elif distance is not None:
        row.distance, steps = distance
        if steps < len(r["tokens"]):
            row.notes.append(f"greedy tokens differ from the reference's at step {steps}; "
                             "distance over the steps before")
    return row


def _metric(samples: list[float]) -> Metric:
    return Metric(statistics.median(samples), samples)


def add_comparisons(rows: list[Row]) -> None:
    """Each Linnet row against the faster peer of this same run, on decode speed."""
    peers = [r for r in rows if r.id in PEERS and r.not_run is None]
    if not peers:
        return
    best = max(peers, key=lambda r: r.measured("decode_tok_s"))
    for row in rows:
        if row.linnet and row.not_run is None:
            row.against = Against(best.id, "decode_tok_s", row.measured("decode_tok_s") / best.measured("decode_tok_s"))
