"""Fuzzing fixtures: small real files to mutate, built once per session from the tiny checkpoints."""
from __future__ import annotations

from pathlib import Path

import pytest

from linnet.gguf.export import export_gguf
from linnet.model import open_model


@pytest.fixture(scope="session")
def tiny_hf(checkpoint_dir) -> Path:
    """An HF directory (config, safetensors, tokenizer with a chat template) to copy and break."""
    return checkpoint_dir("qwen2-tied")


@pytest.fixture(scope="session")
def tiny_gguf(tiny_hf, tmp_path_factory) -> Path:
    return export_gguf(open_model(str(tiny_hf)), tmp_path_factory.mktemp("fuzz-gguf") / "tiny.gguf", "f32")


@pytest.fixture(autouse=True)
def no_weight_cache(monkeypatch):
    """A mutated file is a new source for every example: nothing is kept of it."""
    monkeypatch.setenv("LINNET_CACHE", "off")
