"""``linnet export hf|gguf`` through the CLI: what it prints, and errors as messages, not tracebacks."""
from __future__ import annotations

import json

from linnet.cli import main
from linnet.gguf.format import GGUFFile


def test_export_commands(checkpoint_dir, tmp_path, capsys):
    model = str(checkpoint_dir("qwen2-tied"))
    assert main(["export", "hf", model, "-o", str(tmp_path / "hf"), "--dtype", "f16"]) == 0
    assert f"wrote {tmp_path / 'hf'} (hf, f16) in " in capsys.readouterr().out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float16"

    assert main(["export", "gguf", str(tmp_path / "hf"), "-o", str(tmp_path / "m.gguf"), "--type", "bf16"]) == 0
    assert f"wrote {tmp_path / 'm.gguf'} (gguf, bf16) in " in capsys.readouterr().out
    assert GGUFFile(tmp_path / "m.gguf").metadata["general.architecture"] == "qwen2"


def test_export_error_is_a_message(checkpoint_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "m.gguf"
    assert main(["export", "gguf", str(checkpoint_dir("qwen2-tied")), "-o", str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"linnet: error: cannot write to {out}")
