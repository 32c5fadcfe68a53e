"""The bench's subjects, and what every worker runs: one request of a fixed random prompt, then exactly
``new_tokens`` greedy tokens.

A subject is a peer of ``PEERS`` or any backend of ``linnet.backends.registry``; its id is its row's id.

The first generation of each worker records its logits at the prompt's last position and at the first
``CHECK_STEPS`` decode steps, for the distance from the reference. It also pays any compilation,
which is what warm-ups are for.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from linnet.backends.registry import get_backend
from linnet.registry.schema import Protocol
from linnet.results import Row

CHECK_STEPS = 4  # decode steps compared with the reference, after the prompt's last position
PROMPT_SEED = 0


@dataclass(frozen=True)
class Peer:
    display: str
    group: str


# The peers, by row id. Every other subject is a Linnet backend, named and grouped by the registry.
PEERS = {
    "transformers": Peer("transformers", "PyTorch"),
    "transformers:compiled": Peer("transformers, compiled", "PyTorch"),
    "llama.cpp": Peer("llama.cpp", "LLM engines"),
    "keras-hub": Peer("KerasHub", "JAX"),
    "onnxruntime-genai": Peer("onnxruntime-genai", "ONNX Runtime and TensorRT"),
}
REFERENCE = "transformers"


def empty_row(subject: str) -> Row:
    """A subject's row before any numbers: its id, group and shown name, and whether it is Linnet's."""
    if subject in PEERS:
        return Row(subject, PEERS[subject].group, PEERS[subject].display)
    backend = get_backend(subject)
    return Row(backend.id, backend.group, backend.display, linnet=True)


def random_prompt(vocab_size: int, length: int, seed: int = PROMPT_SEED) -> list[int]:
    """Token ids drawn uniformly from the vocabulary: the same for every worker, no tokenizer needed."""
    return np.random.default_rng(seed).integers(0, vocab_size, length).tolist()


@dataclass(frozen=True)
class Job:
    """Everything a worker needs, written once by the parent as JSON."""

    model: str  # a resolved path
    dtype: str
    protocol: Protocol
    prompt: list[int]
    out_dir: str  # where workers leave their logits

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> Job:
        data = json.loads(path.read_text())
        return cls(**{**data, "protocol": Protocol(**data["protocol"])})

    def logits_path(self, subject: str) -> Path:
        return Path(self.out_dir) / f"{subject.replace(':', '-')}.npy"


@dataclass
class TimedGeneration:
    """One timed generation: prompt in -> first token (ttft), first token -> last token (decode)."""

    ttft_s: float
    decode_s: float
    tokens: list[int]
    logits: np.ndarray | None  # [recorded steps, vocab] float32, when asked to record


class Subject(ABC):
    """A bench subject. Its constructor imports what it needs; ``load`` is what load time measures."""

    @abstractmethod
    def load(self) -> None:
        """From a checkpoint on disk to ready to prefill."""

    @abstractmethod
    def generate(self, prompt: list[int], new_tokens: int, record: int) -> TimedGeneration:
        """Greedy, exactly ``new_tokens`` tokens whatever EOS says; keep the first ``record`` logits."""

    @abstractmethod
    def peak_memory(self) -> int:
        """Peak bytes: the process's RSS high-water mark on CPU, the device's figure on a GPU."""

    def notes(self) -> list[str]:
        return []
