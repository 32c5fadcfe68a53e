"""Architectures, registered by their Hugging Face ``architectures`` name (as llama.cpp and vLLM do).

An architecture is one small file here: its config reader (the spec fields beyond the common ones,
refusing by name what it does not support), the code that builds its Program's layers with
``linnet.program.builder`` (shared pieces in ``linnet.arch.blocks``), its weight names (HF and GGUF
names of each canonical tensor, tensors a checkpoint packs together, and load-time transforms), and its
checkpoint forms: the GGUF metadata it reads and writes (as llama.cpp's graph of its family reads it)
and its config.json keys. Adding one is that file plus its line in ``_MODULES``.
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from linnet.errors import UnsupportedModel

if TYPE_CHECKING:
    from linnet.gguf.reader import GGUFKeys
    from linnet.program.builder import SectionBuilder
    from linnet.spec import ConfigReader, ModelSpec

_MODULES = ("llama", "qwen2", "qwen3", "mistral", "granite", "olmo2", "smollm3", "gemma2", "gemma3", "phi3", "stablelm",
            "gptneox", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss")


@dataclass(frozen=True)
class Packed:
    """A checkpoint tensor that holds several canonical ones (Phi-3's ``qkv_proj``): ``unpack`` cuts it
    into ``parts`` (views where it can), ``pack`` joins them back."""

    parts: tuple[str, ...]
    unpack: Callable[[ModelSpec, np.ndarray], tuple[np.ndarray, ...]]  # a GGUF one cuts rows (axis 0) only
    pack: Callable[[ModelSpec, tuple[np.ndarray, ...]], np.ndarray]

    def groups(self, spec: ModelSpec, template: str, present: Collection[str]) -> list[tuple[str, tuple[str, ...]]]:
        """(checkpoint name, canonical parts) for each layer (or the model, without "{i}") that has every part."""
        prefixes = [(str(i), f"layers.{i}.") for i in range(spec.num_layers)] if "{i}" in template else [("", "")]
        groups = [(template.format(i=i), tuple(prefix + p for p in self.parts)) for i, prefix in prefixes]
        return [(name, parts) for name, parts in groups if all(p in present for p in parts)]


@dataclass(frozen=True)
class Transform:
    """A load-time change of a canonical tensor's values (Gemma's norms store w for 1 + w)."""

    load: Callable[[np.ndarray], np.ndarray]
    save: Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Architecture:
    name: str  # HF architectures name
    family: str  # llama.cpp's name; also the GGUF ``general.architecture``
    model_type: str  # HF config ``model_type``
    read_config: Callable[[ConfigReader], dict[str, Any]]  # spec fields beyond the common ones
    layer: Callable[[SectionBuilder, str], str]  # builds one layer of a kind; returns its x out
    names: dict[str, tuple[str | None, str | None]]  # canonical part -> (HF, GGUF) names; "{i}" the layer
    embed: Callable[[SectionBuilder], str] = field(default=lambda b: _blocks().embed(b))
    head: Callable[[SectionBuilder], str] = field(default=lambda b: _blocks().head(b))
    layer_kinds: Callable[[ModelSpec], tuple[str, ...]] = field(default=lambda s: _blocks().layer_kinds(s))
    tied_by_default: bool = False  # transformers' default for tie_word_embeddings
    eps_key: str = "rms_norm_eps"
    hf_packed: dict[str, Packed] = field(default_factory=dict)  # HF name -> what it packs
    # canonical part -> its HF name in another layout, read where the first is absent (an older
    # transformers'); "{e}" in it: one tensor per expert, stacked along a new first axis
    hf_alternatives: dict[str, str] = field(default_factory=dict)
    hf_transforms: dict[str, Transform] = field(default_factory=dict)  # canonical part -> transform
    hf_config: Callable[[ModelSpec], dict[str, Any]] = field(default=lambda s: {})  # config.json's family keys
    # GGUF, as llama.cpp's graph of ``family`` reads it: its metadata and tensors -> spec fields beyond the
    # common ones (refusing a file that graph would not load); spec -> ``{family}.*`` metadata beyond the
    # common keys (refusing what that graph would compute otherwise); tensors it packs; and whether it
    # rotates interleaved pairs (llama.cpp's "norm" rope), so that q and k rows are permuted in the file.
    gguf_config: Callable[[GGUFKeys], dict[str, Any]] = field(default=lambda keys: {})
    gguf_metadata: Callable[[ModelSpec], dict[str, Any]] = field(default=lambda s: {})
    gguf_packed: dict[str, Packed] = field(default_factory=dict)  # GGUF name -> what it packs
    gguf_interleaved_rope: bool = False


def _blocks() -> Any:
    from linnet.arch import blocks

    return blocks


@functools.cache  # every tensor's name is looked up through it
def _registry() -> dict[str, Architecture]:
    archs = [importlib.import_module(f"linnet.arch.{m}").ARCHITECTURE for m in _MODULES]
    return {a.name: a for a in archs}


def get_architecture(name: str) -> Architecture:
    registry = _registry()
    if name not in registry:
        raise UnsupportedModel(
            f"architecture {name!r} is not supported; supported: {', '.join(sorted(registry))}"
        )
    return registry[name]


def architecture_for_family(family: str, experts: bool = False) -> Architecture:
    """The first registered architecture of llama.cpp's ``family`` (Llama for ``llama``, not Mistral); with
    ``experts`` (the file has ``{family}.expert_count``), the first with a router (Mixtral for ``llama``)."""
    archs = [a for a in _registry().values() if a.family == family]
    if not archs:
        families = sorted({a.family for a in _registry().values()})
        raise UnsupportedModel(f"architecture {family!r} is not supported; supported: {', '.join(families)}")
    return next((a for a in archs if ("router" in a.names) == experts), archs[0])


def supported_architectures() -> list[str]:
    return sorted(_registry())
