"""Architectures, registered by their Hugging Face ``architectures`` name (as llama.cpp and vLLM do).

Each architecture is data: which biases and norms its attention has, and its GGUF name. Adding one is
a small file here plus a line in ``_REGISTRY``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from linnet.errors import UnsupportedModel


@dataclass(frozen=True)
class Architecture:
    name: str  # HF architectures name
    family: str  # short name; also the GGUF ``general.architecture``
    tied_by_default: bool  # transformers' default for tie_word_embeddings
    attention_flags: Callable[[Any], dict[str, bool]]  # config reader -> qkv_bias/o_bias/qk_norm


def _registry() -> dict[str, Architecture]:
    from linnet.arch import llama, qwen2, qwen3

    return {a.name: a for a in (llama.ARCHITECTURE, qwen2.ARCHITECTURE, qwen3.ARCHITECTURE)}


def get_architecture(name: str) -> Architecture:
    registry = _registry()
    if name not in registry:
        raise UnsupportedModel(
            f"architecture {name!r} is not supported; supported: {', '.join(sorted(registry))}"
        )
    return registry[name]


def architecture_for_family(family: str) -> Architecture:
    for arch in _registry().values():
        if arch.family == family:
            return arch
    families = sorted(a.family for a in _registry().values())
    raise UnsupportedModel(f"architecture {family!r} is not supported; supported: {', '.join(families)}")


def supported_architectures() -> list[str]:
    return sorted(_registry())
