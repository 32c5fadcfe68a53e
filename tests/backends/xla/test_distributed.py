"""One model across two processes on loopback (``--num-processes 2``, ``jax.distributed`` over gloo): the
tokens of one process's ``linnet run``, every process drawing the same ones; and the flags refused by name."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from linnet.cli import main

SAMPLED = ["--temperature", "1", "--top-k", "20", "--seed", "3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(devices_per_process: int = 1) -> dict[str, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_process}"
    return env


def run_args(model: Path, prompt: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "linnet", "run", str(model), "--backend", "xla:jax", "--prompt", prompt,
            "--max-new-tokens", "12", "--cache-positions", "64", *extra]


def transformers_greedy(model: Path, prompt_ids: list[int], new_tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def run_alone(model: Path, prompt: str, *extra: str) -> dict:
    done = subprocess.run(run_args(model, prompt, "--json", *extra), env=environment(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def run_together(model: Path, prompt: str, flags: list[list[str]], devices_per_process: int = 1,
                 timeout_s: int = 120) -> list[subprocess.CompletedProcess]:
    """Process i with ``flags[i]``, all joined at one coordinator on loopback; each one's result."""
    coordinator = f"127.0.0.1:{free_port()}"
    started = [subprocess.Popen(run_args(model, prompt, "--num-processes", str(len(flags)), "--process-id", str(i),
                                         "--coordinator", coordinator, "--coordinator-timeout", str(timeout_s), *own),
                                env=environment(devices_per_process), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
               for i, own in enumerate(flags)]
    results = []
    for process in started:
        out, err = process.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return results


@pytest.mark.slow
def test_two_processes_give_the_tokens_of_one(checkpoint_dir):
    # 6 heads, 2 kv heads: both split over the 2 devices, one per process
    model, prompt = checkpoint_dir("qwen3-gqa3"), "the quick brown fox"  # greedy tokens that vary
    for extra in ([], SAMPLED):
        alone = run_alone(model, prompt, *extra)
        if not extra:
            assert alone["token_ids"] == transformers_greedy(model, alone["prompt_ids"], 12)
        together = run_together(model, prompt, [["--json", *extra]] * 2)
        for process in together:
            assert process.returncode == 0, process.stderr[-3000:]
            report = json.loads(process.stdout)  # stdout holds the JSON alone (gloo's connection line goes to stderr)
            assert report["token_ids"] == alone["token_ids"], extra
            assert (report["num_processes"], report["devices"]) == (2, 2)
        assert [json.loads(p.stdout)["process_id"] for p in together] == [0, 1]


@pytest.mark.slow
def test_two_processes_of_two_devices_each_and_only_process_zero_shows_the_text(checkpoint_dir):
    # 4 heads over 4 devices, 2 kv heads kept whole on each (as MQA is)
    model, prompt = checkpoint_dir("qwen2-tied"), "hello there"  # greedy tokens that vary
    alone = run_alone(model, prompt)
    assert alone["token_ids"] == transformers_greedy(model, alone["prompt_ids"], 12)
    first, second = run_together(model, prompt, [["--json"], []], devices_per_process=2)
    assert first.returncode == 0, first.stderr[-3000:]
    assert second.returncode == 0, second.stderr[-3000:]
    report = json.loads(first.stdout)
    assert report["token_ids"] == alone["token_ids"]
    assert report["devices"] == 4
    assert second.stdout == ""
    assert "linnet run: process 1 of 2 done (12 tokens); process 0 shows the text" in second.stderr


@pytest.mark.slow
def test_heads_that_the_processes_do_not_divide_are_refused_by_name(checkpoint_dir):
    model = checkpoint_dir("phi3-partial")  # 3 heads, 1 kv head
    for process in run_together(model, "hi", [[], []]):
        assert process.returncode == 2
        assert ("linnet: error: --num-processes 2: the 2 devices of all the processes do not divide the model's 3 "
                "attention heads") in process.stderr


@pytest.mark.slow
def test_a_process_that_never_comes_is_a_timeout_error_not_a_hang(checkpoint_dir):
    """Process 1 with no coordinator, and process 0 (the coordinator) with no process 1, at once."""
    model = checkpoint_dir("qwen3-gqa3")
    ports = free_port(), free_port()
    alone = [subprocess.Popen(run_args(model, "hi", "--num-processes", "2", "--process-id", str(i), "--coordinator",
                                       f"127.0.0.1:{port}", "--coordinator-timeout", "2"),
                              env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, port in enumerate(ports)]
    (out0, err0), (out1, err1) = (process.communicate(timeout=120) for process in alone)
    assert [process.returncode for process in alone] == [2, 2]
    assert out0 == out1 == ""
    assert err0.strip().splitlines()[-1] == (
        f"linnet: error: --num-processes 2: the other 1 process(es) did not all connect to the coordinator at "
        f"127.0.0.1:{ports[0]} within 2 s; start each with --coordinator 127.0.0.1:{ports[0]} and its own "
        "--process-id")
    assert err1.strip().splitlines()[-1] == (
        f"linnet: error: --num-processes 2: no coordinator answered at 127.0.0.1:{ports[1]} within 2 s; start "
        "process 0 (--process-id 0) on that host, or check the address and port")


@pytest.mark.parametrize("flags, message", [
    (["--num-processes", "2", "--process-id", "0", "--coordinator", "127.0.0.1:1"],
     "--num-processes runs xla:jax across processes; give --backend xla:jax, not the default backend"),
    (["--backend", "xla:stablehlo", "--num-processes", "2", "--process-id", "0", "--coordinator", "127.0.0.1:1"],
     "--num-processes runs xla:jax across processes; give --backend xla:jax, not xla:stablehlo"),
    (["--backend", "xla:jax", "--num-processes", "2", "--coordinator", "127.0.0.1:1"],
     "--num-processes 2 needs --process-id, 0 to 1"),
    (["--backend", "xla:jax", "--num-processes", "2", "--process-id", "2", "--coordinator", "127.0.0.1:1"],
     "--process-id must be 0 to 1 with --num-processes 2, got 2"),
    (["--backend", "xla:jax", "--num-processes", "2", "--process-id", "1"],
     "--num-processes needs --coordinator HOST:PORT, the address process 0 listens on"),
    (["--backend", "xla:jax", "--process-id", "0", "--coordinator", "127.0.0.1:1"],
     "--process-id and --coordinator go with --num-processes 2 or more"),
    (["--backend", "xla:jax", "--num-processes", "2", "--process-id", "0", "--coordinator", "127.0.0.1:1",
      "--devices", "2"],
     "--devices 2: with --num-processes the mesh is every device of every process; leave --devices out"),
    (["--backend", "xla:jax", "--num-processes", "2", "--process-id", "0", "--coordinator", "127.0.0.1:1",
      "--temperature", "0.7"],
     "--num-processes with --temperature above 0 needs --seed, the same in every process, so that every process "
     "draws the same tokens"),
])
def test_process_flags_are_refused_by_name(checkpoint_dir, capsys, flags, message):
    model = checkpoint_dir("qwen3-gqa3")
    capsys.readouterr()  # building the checkpoint writes progress bars
    code = main(["run", str(model), "--prompt", "hi", *flags])
    assert code == 2
    assert capsys.readouterr().err.strip() == f"linnet: error: {message}"


@pytest.mark.parametrize("address", ["127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", ":8476", "my host:8476"])
def test_a_coordinator_that_is_not_host_and_port_is_refused_by_name(capsys, address):
    with pytest.raises(SystemExit) as exit:
        main(["run", "--backend", "xla:jax", "--prompt", "hi", "--coordinator", address])
    assert exit.value.code == 2
    assert "argument --coordinator:" in capsys.readouterr().err
