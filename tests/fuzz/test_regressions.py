"""Every input a fuzzer (or a review) ever found to crash a reader, kept under regressions/ and replayed.

Each folder is one reader; a file is either a whole input (``.gguf``, ``.json``, ``.toml``, ``.safetensors``)
or, where the input is a real file with a few fields changed, those fields as JSON over the tiny file.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from fuzz_harness import REGRESSIONS, clean
from test_fuzz_files import read_hf
from test_fuzz_gguf import read_gguf, rewrite, typed

from linnet import registry
from linnet.errors import RegistryError
from linnet.gguf.format import GGUFFile
from linnet.registry.schema import Entry, check_entry, parse
from linnet.results import load_results


def cases(reader: str) -> list[Path]:
    return sorted((REGRESSIONS / reader).glob("*"))


@pytest.mark.parametrize("path", cases("gguf"), ids=lambda p: p.name)
def test_gguf_files(path):
    clean(lambda: read_gguf(path), path)


@pytest.mark.parametrize("path", cases("gguf-metadata"), ids=lambda p: p.name)
def test_gguf_metadata(path, tiny_gguf, tmp_path):
    source = GGUFFile(tiny_gguf)
    metadata = {k: typed(v) for k, v in source.metadata.items() if k != "general.architecture"}
    metadata.update({k: typed(v) for k, v in json.loads(path.read_text()).items()})
    out = tmp_path / "m.gguf"
    rewrite(source, out, metadata, source.metadata["general.architecture"])
    clean(lambda: read_gguf(out), out)


@pytest.mark.parametrize("path", cases("hf-files"), ids=lambda p: p.name)
def test_hf_files(path, tiny_hf, tmp_path):
    """``NAME.ORIGINAL`` replaces the tiny checkpoint's file ORIGINAL (config.json, model.safetensors...)."""
    model = Path(shutil.copytree(tiny_hf, tmp_path / "model"))
    shutil.copyfile(path, model / path.name.split(".", 1)[1])
    clean(lambda: read_hf(model), model)


@pytest.mark.parametrize("path", cases("registry-data"), ids=lambda p: p.name)
def test_registry_data(path):
    data = {**dataclasses.asdict(registry.entries()[0]), **json.loads(path.read_text())}
    clean(lambda: check_entry(parse(Entry, data, path.name, RegistryError), path.name), path.name)


@pytest.mark.parametrize("path", cases("results"), ids=lambda p: p.name)
def test_results_files(path):
    clean(lambda: load_results(path), path)
