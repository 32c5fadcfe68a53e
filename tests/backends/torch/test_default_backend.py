"""`linnet run` without --backend where onnx:cpu is not the choice (not installed, a GPU, a 16-bit dtype):
torch:eager, with a note, until torch:inductor's packages are on disk."""
from __future__ import annotations

import json

from linnet.cli import main


def test_run_without_packages_runs_eager_and_says_how_to_compile(checkpoint_dir, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("LINNET_CACHE", str(tmp_path))  # no package another test compiled
    monkeypatch.setattr("linnet.commands.run.onnx_when_fastest", lambda dtype: None)  # as without ONNX Runtime
    assert main(["run", str(checkpoint_dir("qwen3-gqa3")), "--prompt", "The quick", "--max-new-tokens", "3",
                 "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["backend"] == "torch:eager" and out["compile_s"] == 0
    assert "--backend torch:inductor" in captured.err
