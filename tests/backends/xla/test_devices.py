"""``xla:jax`` sharded over several devices gives the tokens of one device; forced host devices stand in
for accelerators (``XLA_FLAGS=--xla_force_host_platform_device_count=4``, set before JAX starts, hence
the subprocess)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
from linnet.backends import CacheShape, create_runner
from linnet.errors import LinnetError
from linnet.generation import Sampling, generate
from linnet.model import open_model

out = {}
for case, path, devices in json.loads(sys.argv[1]):
    weights = open_model(path).weights
    tokens = []
    for n in (1, devices):
        runner = create_runner("xla:jax", weights, CacheShape(rows=2, positions=64), devices=n)
        runner.prefill_chunk = 8  # a 13-token prompt in two chunks
        greedy = generate(runner, list(range(3, 16)), 12, eos_ids=[]).token_ids
        sampled = generate(runner, [5, 9, 4], 12, Sampling(1.0, top_k=20, seed=3), eos_ids=[]).token_ids
        tokens.append((greedy, sampled))
    out[f"{case} on {devices}"] = tokens
for case, path, devices in json.loads(sys.argv[2]):
    try:
        create_runner("xla:jax", open_model(path).weights, CacheShape(1, 16), devices=devices)
        out[f"error {case} on {devices}"] = "no error"
    except LinnetError as e:
        out[f"error {case} on {devices}"] = str(e)
print(json.dumps(out))
"""


def run_on_four_host_devices(runs: list, errors: list) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(runs), json.dumps(errors)], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sharded_runs_give_the_tokens_of_one_device(checkpoint_dir):
    runs = [
        ("qwen3-gqa3", str(checkpoint_dir("qwen3-gqa3")), 2),  # kv heads split over the devices
        ("qwen2-tied", str(checkpoint_dir("qwen2-tied")), 4),  # 2 kv heads on 4 devices: kept whole
        ("llama-gqa3", str(checkpoint_dir("llama-gqa3")), 3),  # 6 heads over 3 devices, kv whole
    ]
    out = run_on_four_host_devices(runs, [])
    for name, (one, sharded) in out.items():
        assert sharded == one, name


def test_devices_beyond_those_present_or_not_dividing_the_heads_are_errors(checkpoint_dir):
    path = str(checkpoint_dir("qwen2-tied"))  # 4 heads
    out = run_on_four_host_devices([], [("qwen2-tied", path, 8), ("qwen2-tied", path, 3)])
    assert out["error qwen2-tied on 8"] == "--devices 8 asks for more devices than the 4 cpu device(s) JAX sees here"
    assert out["error qwen2-tied on 3"] == "--devices 3 does not divide the model's 4 attention heads"
