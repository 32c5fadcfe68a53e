"""Machine kinds: runs are shown and compared only within one kind.

A GPU is its model ("NVIDIA H100 80GB HBM3"). A CPU is its model name with its widest vector units
("AMD EPYC (AVX2)", "Intel Xeon (AVX-512, AMX)"): VMs sold under one model name come with and without
AVX-512, and their products differ about twice over. Results record the units since 2026-12-04
("AMD EPYC (AVX2), 2 cores"); an older file's are read from its name where it says them
(``*.epyc-avx2-2c.*``: a token ``avx2``, ``avx512`` or ``amx``), and are otherwise "unknown vector units",
never guessed. Published results are a kind of their own, labelled so.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from linnet.results import Machine

# File-name tokens that say which vector units a CPU had, in the order results list them.
FILE_UNITS = (("avx2", "AVX2"), ("avx512", "AVX-512"), ("amx", "AMX"))
UNKNOWN = "unknown vector units"


@dataclass(frozen=True)
class Kind:
    label: str  # "AMD EPYC (AVX2)", "NVIDIA H100 80GB HBM3"
    gpu: bool
    published: bool = False

    @property
    def name(self) -> str:
        return f"{self.label} · published" if self.published else self.label

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")


def cpu_name(cpu: str | None) -> str:
    """The model name without trademarks, clock or core count: "Intel(R) Xeon(R) Processor, 2 cores" ->
    "Intel Xeon"; recorded vector units stay ("AMD EPYC (AVX2)")."""
    name = re.sub(r",\s*\d+ cores?$", "", cpu or "unknown CPU")
    name = re.sub(r"\((?:R|TM)\)|\bProcessor\b|\bCPU\b|@.*", "", name, flags=re.IGNORECASE)
    return " ".join(name.split())


def kind(machine: Machine, file_name: str, published: bool = False) -> tuple[Kind, str | None]:
    """The run's kind, and where its vector units came from when the run did not record them."""
    if machine.accelerator:
        return Kind(machine.accelerator, gpu=True, published=published), None
    name = cpu_name(machine.cpu)
    if "(" in name:
        return Kind(name, gpu=False, published=published), None
    tokens = re.split(r"[.-]", file_name.lower())
    found = [(token, shown) for token, shown in FILE_UNITS if token in tokens]
    if found:
        return (Kind(f"{name} ({', '.join(shown for _, shown in found)})", gpu=False, published=published),
                f"the run recorded {machine.cpu!r}; its vector units are read from its file's name "
                f"({', '.join(repr(token) for token, _ in found)})")
    return (Kind(f"{name} ({UNKNOWN})", gpu=False, published=published),
            f"the run recorded {machine.cpu!r}, without its vector units")
