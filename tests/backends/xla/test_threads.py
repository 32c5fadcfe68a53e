"""``--threads N`` reaches XLA: its CPU client sizes its thread pools from the CPUs the process may use, so
the process is kept on N of them before JAX starts (in a subprocess: the setting is the process's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

COUNT = """
import json, os, sys
from linnet.backends import CacheShape, create_runner
from linnet.backends.registry import get_backend
from linnet.model import open_model

if sys.argv[2] != "default":
    get_backend("xla:jax").package.set_threads(int(sys.argv[2]))
runner = create_runner("xla:jax", open_model(sys.argv[1]).weights, CacheShape(1, 32))
runner.warm_up()
print(json.dumps({"os_threads": len(os.listdir("/proc/self/task")), "threads": runner.describe()["threads"]}))
"""


def linnet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "linnet", *args], capture_output=True, text=True, timeout=300)


def count(path: str, threads: str) -> dict:
    result = subprocess.run([sys.executable, "-c", COUNT, path, threads], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs to tell one thread from several")
def test_one_thread_gives_xla_smaller_pools_and_the_same_tokens(checkpoint_dir):
    path = str(checkpoint_dir("qwen2-tied"))
    one, default = count(path, "1"), count(path, "default")
    assert one["threads"] == 1 and default["threads"] == len(os.sched_getaffinity(0))
    assert one["os_threads"] < default["os_threads"]  # the client's pools, sized from the CPUs it may use
    runs = [linnet("run", path, "--backend", "xla:jax", "--prompt", "hello", "--max-new-tokens", "6", "--json",
                   *threads) for threads in (["--threads", "1"], [])]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    one, default = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert one["threads"] == 1 and one["token_ids"] == default["token_ids"]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs CPU affinity (Linux)")
def test_more_threads_than_cpus_is_an_error(checkpoint_dir):
    cpus = len(os.sched_getaffinity(0))
    result = linnet("run", str(checkpoint_dir("qwen2-tied")), "--backend", "xla:jax", "--prompt", "hi",
                    "--threads", str(cpus + 1))
    assert result.returncode == 2  # refused by the command line, before the model loads
    assert result.stderr.strip() == (f"linnet: error: argument --threads: must be at most {cpus}, the CPUs this "
                                     f"process may use, got {cpus + 1} (`linnet run --help` lists the options)")
