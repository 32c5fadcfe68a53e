"""The ``gguf_case_dir`` fixture: shared checkpoints and the cases ``gguf_cases`` builds."""
from __future__ import annotations

from pathlib import Path

import pytest
from checkpoints import build_checkpoint
from gguf_cases import BUILT


@pytest.fixture(scope="session")
def gguf_case_dir(checkpoint_dir, tmp_path_factory: pytest.TempPathFactory):
    """``gguf_case_dir(case_id)`` -> the directory of a shared checkpoint or of a variant (built once)."""
    built: dict[str, Path] = {}

    def get(case_id: str) -> Path:
        if case_id not in BUILT:
            return checkpoint_dir(case_id)
        if case_id not in built:
            built[case_id] = build_checkpoint(BUILT[case_id], tmp_path_factory.mktemp(case_id))
        return built[case_id]

    return get
