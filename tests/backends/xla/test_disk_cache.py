"""A second process loads the executables the first compiled (JAX's persistent cache for what ``jax.jit``
compiles, Linnet's own for the StableHLO modules; both under ``$LINNET_CACHE``) and gives the same tokens."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
import jax.monitoring
from linnet.backends import CacheShape, create_runner
from linnet.generation import generate
from linnet.model import open_model

events = []
jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
runner = create_runner(sys.argv[1], open_model(sys.argv[2]).weights, CacheShape(rows=2, positions=32))
runner.warm_up()
tokens = generate(runner, [3, 5, 7], 6, eos_ids=[]).token_ids
print(json.dumps({"tokens": tokens, "jit_misses": events.count("/jax/compilation_cache/cache_misses"),
                  "jit_hits": events.count("/jax/compilation_cache/cache_hits")}))
"""


def run(backend: str, path: str, cache: str) -> dict:
    env = {**os.environ, "LINNET_CACHE": cache, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, backend, path], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["xla:jax", "xla:stablehlo"])
def test_a_second_process_compiles_nothing(checkpoint_dir, tmp_path, backend):
    path = str(checkpoint_dir("qwen2-tied"))
    first = run(backend, path, str(tmp_path))
    written = executables(tmp_path)
    second = run(backend, path, str(tmp_path))
    assert second["tokens"] == first["tokens"]
    assert first["jit_misses"] > 0 and second["jit_misses"] == 0 and second["jit_hits"] >= first["jit_misses"]
    assert (len(written) > 0) == (backend == "xla:stablehlo")  # its decode and prefill modules
    assert executables(tmp_path) == written  # none compiled again: a compiled module is written anew


def executables(cache) -> dict[str, tuple[int, int]]:
    """Each StableHLO executable file and its identity (inode, modification time)."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (cache / "xla" / "stablehlo").glob("*.bin")}
