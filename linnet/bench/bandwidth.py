"""The machine's read bandwidth, measured in the run, and each decode row's reads against it.

A batch-1 decode step streams every weight it multiplies by once, plus the KV cache up to its position,
so its speed is bounded by bytes per token / read bandwidth. The bench measures that bandwidth itself,
in a process started as the workers are (same threads, same OpenMP settings), by summing a float32
buffer far larger than any cache with torch; each decode row is then reported as the bytes a step
must read x its tokens per second, and as a share of the measured bandwidth. The measuring process
takes its turn after each round of timed generations (``TurnSampler``): on a shared machine whose
bandwidth swings within seconds, samples taken only before and after the runs saw two moments of it,
and a row's share of them said more about when they were taken than about the row.

The bytes are what a step must read, counted alike for every subject: each matrix once (the embedding
table only for its one row, unless the head is tied to it and reads it whole), and the KV cache's keys
and values at the mean position of the timed steps. A mixture of experts' routed experts count top_k of
their number (``ModelSpec.token_share``: what one token's step reads of them, from the Program), its router,
shared expert and dense parts whole. A runner that reads more (a fixed-shape cache read whole, every expert,
say) has that cost in its speed, not in its byte count.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from linnet.bench.machine import run_measurement
from linnet.bench.protocol import PEERS, Job
from linnet.dtypes import DTYPES
from linnet.errors import LinnetError
from linnet.gguf.format import GGUFFile
from linnet.gguf.reader import tensor_plan
from linnet.registry.schema import Protocol
from linnet.results import Machine, Row
from linnet.spec import ModelSpec

BUFFER_BYTES = 2**30  # 1 GiB: hundreds of times any CPU cache
PASSES = 5


def measure(buffer_bytes: int = BUFFER_BYTES, passes: int = PASSES) -> list[float]:
    """GB/s of each timed pass of a float32 sum over ``buffer_bytes``, after one untimed pass."""
    buffer = _resident(buffer_bytes)
    return _passes(buffer, passes)


def _resident(buffer_bytes: int) -> Any:
    import torch

    buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)  # written once: every page is resident
    buffer.sum()
    return buffer


def _passes(buffer: Any, passes: int) -> list[float]:
    samples = []
    for _ in range(passes):
        start = time.perf_counter()
        buffer.sum()
        samples.append(buffer.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return samples


class TurnSampler:
    """The read bandwidth as one more subject of the bench's turns: a process of its own, started as the
    workers are, holding its buffer resident and timing ``passes`` passes over it each time it is asked
    (``sample``); between two turns it waits on its input, its threads asleep."""

    def __init__(self, env: dict[str, str], buffer_bytes: int = BUFFER_BYTES, passes: int = PASSES):
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-m", "linnet.bench.bandwidth", str(buffer_bytes), str(passes), "--turns"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
            start_new_session=True)  # a Ctrl-C reaches the bench alone, which closes this

    def sample(self) -> list[float]:
        assert self.process.stdin is not None and self.process.stdout is not None  # both piped
        try:
            self.process.stdin.write("\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it has exited: the empty read below says so
        line = self.process.stdout.readline()
        if not line:  # its error went to stderr, as the workers' do
            raise LinnetError(f"measuring the read bandwidth failed: its process exited with status "
                              f"{self.process.wait()}")
        return [float(x) for x in json.loads(line)]

    def close(self) -> None:
        """End the process: its input closed, it exits; killed if it has not within a few seconds."""
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()
            self.process.wait(timeout=10)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()


def measure_apart(env: dict[str, str], log: Any = sys.stderr, buffer_bytes: int = BUFFER_BYTES,
                  passes: int = PASSES) -> list[float]:
    """``measure`` in a process of its own with ``env``, as the bench's workers run."""
    return run_measurement("linnet.bench.bandwidth", [str(buffer_bytes), str(passes)], env, "read bandwidth", log)


@dataclass(frozen=True)
class TokenReads:
    """The bytes one timed decode step must read."""

    weights: int
    weight_type: str  # "f32", "q4_1", or "q4_1, q6_k, f32" for a GGUF file's mixture, most bytes first
    kv_cache: int
    kv_type: str
    position: float  # the keys each step attends over, on average

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache

    def note(self, decode_tok_s: float, bandwidth_gb_s: float) -> str:
        rate = self.total * decode_tok_s / 1e9
        return (f"reads {self.total / 1e6:.2f} MB per token (weights {self.weights / 1e6:.2f} MB in "
                f"{self.weight_type}, KV cache {self.kv_cache / 1e6:.2f} MB in {self.kv_type} at "
                f"{self.position:g} positions on average): {rate:.2f} GB/s, "
                f"{rate / bandwidth_gb_s:.0%} of the read bandwidth measured in this run")


def mean_position(protocol: Protocol) -> float:
    """Keys attended over, averaged over the timed steps: step k of 1..N-1 feeds token k at position
    P + k - 1 and reads P + k positions, so the mean is P + N / 2."""
    return protocol.prompt_tokens + protocol.new_tokens / 2


def element_bytes(type_name: str) -> float:
    """Bytes per element: a Linnet dtype's, or a GGML type's (a block's bytes over its elements)."""
    if type_name in DTYPES:
        return DTYPES[type_name].numpy.itemsize
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name.upper()]]
    except KeyError:
        raise LinnetError(f"unknown weight type {type_name!r}") from None
    return size / block


def kv_cache_bytes(spec: ModelSpec, position: float, kv_type: str) -> int:
    return round(2 * spec.num_layers * spec.kv_size * position * element_bytes(kv_type))


def weights_in_dtype(spec: ModelSpec, weight_type: str) -> dict[str, int]:
    """Bytes a step reads with every weight in ``weight_type`` (Linnet's runners, transformers)."""
    streamed = spec.active_parameter_count()
    if not spec.tie_word_embeddings:  # the embedding gives one row; the head's own matrix is read whole
        streamed -= (spec.vocab_size - 1) * spec.hidden_size
    return {weight_type: round(streamed * element_bytes(weight_type))}


def weights_of_gguf(path: str | Path, spec: ModelSpec) -> dict[str, int]:
    """Bytes a step reads, by GGML type, with a GGUF file's tensors as stored (as llama.cpp runs them)."""
    tensors, plan = GGUFFile(path).tensors, tensor_plan(spec)
    tied = "output.weight" not in tensors
    by_type: dict[str, int] = {}
    for t in tensors.values():
        read = t.nbytes // spec.vocab_size if t.name == "token_embd.weight" and not tied else t.nbytes
        read = round(read * spec.token_share(plan[t.name][0][0])) if t.name in plan else read
        by_type[t.type.name.lower()] = by_type.get(t.type.name.lower(), 0) + read
    return by_type


def token_reads(spec: ModelSpec, protocol: Protocol, weights: dict[str, int], kv_type: str) -> TokenReads:
    """``weights`` (bytes by type) and the KV cache at the mean position."""
    position = mean_position(protocol)
    types = ", ".join(sorted(weights, key=weights.__getitem__, reverse=True))
    return TokenReads(sum(weights.values()), types, kv_cache_bytes(spec, position, kv_type), kv_type, position)


# What llama.cpp reads: the file it runs (``linnet.bench.peers_llamacpp``), with its KV cache type.
def gguf_for(job: Job) -> Path:
    """The file llama.cpp runs: the model itself, or its export in the run's dtype."""
    source = Path(job.model)
    return source if source.suffix == ".gguf" else Path(job.out_dir) / f"llama.cpp-{job.dtype}.gguf"


def kv_type(weights: dict[str, int]) -> str:
    """f32 beside f32 weights (as Linnet's CPU cache: an f32 row is f32 throughout), else llama.cpp's f16."""
    return "f32" if max(weights, key=weights.__getitem__) == "f32" else "f16"


def llama_cpp_reads(job: Job, spec: ModelSpec) -> TokenReads:
    weights = weights_of_gguf(gguf_for(job), spec)
    return token_reads(spec, job.protocol, weights, kv_type(weights))


BLOCKS_NOTE = "matrices in llama.cpp's blocks"  # a Linnet worker's note when it runs a GGUF file's blocks


def subject_reads(subject: str, job: Job, spec: ModelSpec, accelerated: bool, blocks: bool = False,
                  kv: str | None = None) -> TokenReads:
    """What one decode step of ``subject`` must read: its weights in the run's dtype, or with ``blocks`` a
    GGUF file's matrices as stored, as llama.cpp does; and its KV cache in ``kv``, the dtype a Linnet
    runner reports keeping it in (a peer's, or where none is reported: the run's dtype on an accelerator,
    else f32)."""
    if subject == "llama.cpp":
        return llama_cpp_reads(job, spec)
    kv = kv or (job.dtype if accelerated or subject in PEERS else "f32")
    in_file = blocks and str(job.model).endswith(".gguf")
    weights = weights_of_gguf(job.model, spec) if in_file else weights_in_dtype(spec, job.dtype)
    return token_reads(spec, job.protocol, weights, kv)


def reads_of_subjects(job: Job, spec: ModelSpec, reports: dict[str, dict[str, Any]]) -> dict[str, TokenReads]:
    """``subject_reads`` of every subject that ran, given the workers' reports."""
    accelerated = any(r.get("accelerator") for r in reports.values())
    return {s: subject_reads(s, job, spec, accelerated, any(n.startswith(BLOCKS_NOTE) for n in r.get("notes", [])),
                             r.get("kv_cache_dtype"))
            for s, r in reports.items() if "not_run" not in r}


def add_notes(rows: list[Row], reads: dict[str, TokenReads], gb_s: float) -> None:
    """Each decode row's reads per token, as GB/s and as a share of ``gb_s``, in its notes."""
    for row in rows:
        if row.id in reads and row.not_run is None:
            row.notes.append(reads[row.id].note(row.measured("decode_tok_s"), gb_s))


_NOTE = re.compile(r"^reads ([0-9.]+) MB per token ")


def measured(machine: Machine) -> str:
    """The measured read bandwidth, for a summary's machine line; "" where none was measured."""
    m = machine.read_gb_s
    if m is None:
        return ""
    spread = f" ({min(m.samples):.1f}-{max(m.samples):.1f} over {len(m.samples)} passes)" if m.samples else ""
    return f" · read bandwidth {m.value:.1f} GB/s{spread}"


def read_rate(row: Row, machine: Machine) -> str:
    """A decode row's reads per token x tokens per second, and its share of the measured bandwidth,
    from the figure ``TokenReads.note`` left in its notes; "–" without one."""
    mb = next((float(m[1]) for n in row.notes if (m := _NOTE.match(n))), None)
    if mb is None or machine.read_gb_s is None:
        return "–"
    rate = mb * row.measured("decode_tok_s") / 1e3
    return f"{rate:.2f} GB/s, {rate / machine.read_gb_s.value:.0%}"


def _serve_turns(buffer_bytes: int, passes: int) -> None:
    """``TurnSampler``'s process: a line of samples for each line read, until its input closes."""
    buffer = _resident(buffer_bytes)
    for _ in sys.stdin:
        print(json.dumps(_passes(buffer, passes)), flush=True)


if __name__ == "__main__":
    if sys.argv[3:] == ["--turns"]:
        _serve_turns(int(sys.argv[1]), int(sys.argv[2]))
    else:
        print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]))), flush=True)
