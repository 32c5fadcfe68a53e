"""Shared fixtures: tiny checkpoints built once per session, and a private converted-weights cache."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so tests import checkpoints.py as a plain module

from checkpoints import CASES_BY_ID, build_checkpoint  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def private_linnet_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("linnet-cache")
    os.environ["LINNET_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """``checkpoint_dir(case_id, dtype="float32")`` -> directory of that tiny checkpoint (built once)."""
    built: dict[tuple[str, str], Path] = {}

    def get(case_id: str, dtype: str = "float32") -> Path:
        key = (case_id, dtype)
        if key not in built:
            built[key] = build_checkpoint(CASES_BY_ID[case_id], tmp_path_factory.mktemp(f"{case_id}-{dtype}"), dtype)
        return built[key]

    return get
