"""Commands that run no model import no torch: each is run in a fresh interpreter, which then must not
have loaded it (a failure prints where it was first imported)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from linnet.gguf.export import export_gguf
from linnet.model import open_model

PROBE = """
import sys, traceback

class Watch:  # remembers who first imports torch
    stack = None

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and Watch.stack is None:
            Watch.stack = "".join(traceback.format_stack()[:-1])

sys.meta_path.insert(0, Watch())
{body}
if "torch" in sys.modules:
    sys.exit("torch was imported:\\n" + Watch.stack)
"""


def run_without_torch(body: str) -> None:
    result = subprocess.run([sys.executable, "-c", PROBE.format(body=body)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.fixture(scope="module")
def models(checkpoint_dir, tmp_path_factory) -> dict[str, str]:
    hf = checkpoint_dir("qwen2-tied")
    gguf = export_gguf(open_model(str(hf)), tmp_path_factory.mktemp("gguf") / "m.gguf", "q8_0")
    return {"hf": str(hf), "gguf": str(gguf)}


def test_import_linnet():
    run_without_torch("import linnet")


@pytest.mark.parametrize("argv", [
    ["info", "{hf}"], ["info", "{gguf}"], ["models"], ["export", "hf", "{hf}", "-o", "{out}/hf"],
    ["export", "gguf", "{hf}", "-o", "{out}/m.gguf"], ["site", "-o", "{out}/site"],
], ids=["info-hf", "info-gguf", "models", "export-hf", "export-gguf", "site"])
def test_command(argv, models, tmp_path):
    argv = [a.format(out=tmp_path, **models) for a in argv]
    run_without_torch(f"from linnet.cli import main\nassert main({argv!r}) == 0")
