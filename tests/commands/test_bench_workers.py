"""``linnet bench`` run from a folder holding a directory named ``linnet`` (a clone, say): its workers
import the Linnet that runs the bench, not that directory."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # a minute on 2 cores: four worker processes start torch
def test_bench_beside_a_folder_named_linnet(checkpoint_dir, tmp_path):
    (tmp_path / "linnet").mkdir()
    (tmp_path / "linnet" / "README.md").write_text("a clone of Linnet, say\n")
    linnet = Path(sys.executable).parent / "linnet"
    result = subprocess.run(
        [str(linnet), "bench", str(checkpoint_dir("qwen2-tied")), "--backend", "torch:eager", "--peer",
         "transformers", "--prompt-tokens", "4", "--new-tokens", "2", "--warmup", "0", "--runs", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "not run" not in result.stdout and "__version__" not in result.stderr
    assert "bandwidth" in result.stdout  # the table came out
