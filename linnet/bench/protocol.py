"""What every worker runs: one request of a fixed random prompt, then exactly ``new_tokens`` greedy tokens.

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

from linnet.registry.schema import Protocol

CHECK_STEPS = 4  # decode steps compared with the reference, after the prompt's last position
PROMPT_SEED = 0
REFERENCE = "transformers"
LINNET_BACKENDS = ("torch:eager", "torch:inductor", "torch:cudagraphs")
PEERS = ("transformers", "transformers:compiled")
# Row names, as on the seed pages; all in the "PyTorch" group.
ROW_NAMES = {
    "transformers": "transformers",
    "transformers:compiled": "transformers, compiled",
    "torch:eager": "Linnet, generated PyTorch",
    "torch:inductor": "Linnet, inductor",
    "torch:cudagraphs": "Linnet, CUDA graphs",
}


def random_prompt(vocab_size: int, length: int, seed: int = PROMPT_SEED) -> list[int]:
    """Token ids drawn uniformly from the vocabulary: the same for every worker, no tokenizer needed."""
    return np.random.default_rng(seed).integers(0, vocab_size, length).tolist()


def cache_positions(prompt_tokens: int, new_tokens: int, multiple: int = 128) -> int:
    return -(-(prompt_tokens + new_tokens) // multiple) * multiple


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
class Generation:
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
    def generate(self, prompt: list[int], new_tokens: int, record: int) -> Generation:
        """Greedy, exactly ``new_tokens`` tokens whatever EOS says; keep the first ``record`` logits."""

    @abstractmethod
    def peak_memory(self) -> int:
        """Peak bytes: the process's RSS high-water mark on CPU, the device's figure on a GPU."""

    def notes(self) -> list[str]:
        return []
