"""``linnet compile --target``: one target per artifact a backend writes (a package's name, or each of its
modes where it writes one per mode), plus ``program``."""
from __future__ import annotations

import subprocess
import sys

from linnet.commands.compile import targets, writers


def test_the_targets_are_program_and_each_writer():
    assert targets() == ["program", *writers()]
    assert {"torch", "onnx", "jax", "stablehlo"} <= set(writers()) and "xla" not in writers()
    assert writers()["stablehlo"] == "linnet.backends.xla.artifact:write_stablehlo"


def test_a_target_that_is_not_one_is_refused_with_the_choices(checkpoint_dir, tmp_path):
    result = subprocess.run([sys.executable, "-m", "linnet", "compile", str(checkpoint_dir("qwen2-tied")),
                             "--target", "xla", "-o", str(tmp_path / "out")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "argument --target: invalid choice: 'xla'" in result.stderr
    assert "'jax'" in result.stderr and "'stablehlo'" in result.stderr and not (tmp_path / "out").exists()
