"""The generated module's fixed functions are ``step_functions``' text, copied part by part: each part reaches
the programs that need it, and no other; a program without matrices in blocks names no ``Blocks``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_codegen import SPECS

from linnet.backends.torch import codegen
from linnet.backends.torch.codegen import generate_source, step_function_parts
from linnet.backends.torch.runner import torch_program
from linnet.model import open_model
from linnet.program.rings import ring_caches
from linnet.spec import spec_from_hf_config

PARTS = ["norms", "linear", "rms_linear", "blocks", "layer_norm", "moe", "rings", "ops"]


def sources(checkpoint_dir) -> dict[str, str]:
    """Programs that between them need every part."""
    llama = spec_from_hf_config(SPECS["llama3_tiny"])
    gemma = open_model(str(checkpoint_dir("gemma2-softcap-window6"))).spec
    return {
        "plain": generate_source(torch_program(llama)),
        "blocks": generate_source(torch_program(llama, quantize="q8_0")),
        "layer_norm": generate_source(torch_program(open_model(str(checkpoint_dir("gptneox-parallel"))).spec)),
        "moe": generate_source(torch_program(open_model(str(checkpoint_dir("mixtral-top2of5"))).spec)),
        "rings": generate_source(ring_caches(torch_program(gemma), 64, 4, 63)),
    }


def test_each_part_is_copied_as_written_into_the_programs_that_need_it(checkpoint_dir):
    parts = step_function_parts()
    assert list(parts) == PARTS
    made = sources(checkpoint_dir)
    for name, source in made.items():
        # as written, or with its weights annotated as tensors where no matrix is in blocks
        copied = {part for part, text in parts.items() if text in source or codegen._tensors_only(text) in source}
        wanted = {"norms", "rms_linear", "ops"} | ({"linear", "blocks"} if name == "blocks" else {name} - {"plain"})
        assert copied == wanted, name
    assert "class Blocks" not in made["plain"] and "Blocks" not in made["plain"] and "Blocks" not in made["moe"]
    assert "def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None)" in made["plain"]
    assert 'w: "torch.Tensor | Blocks"' in made["blocks"] and "if isinstance(w, Blocks):" in made["blocks"]


def test_the_step_functions_file_holds_only_parts_and_stand_ins():
    """What comes before the first part is never copied: it may hold only imports and the stand-ins for the
    generated module's constants, so that every function a program needs lives in a part."""
    text = Path(codegen.__file__).with_name("step_functions.py").read_text()
    preamble = ast.parse(text[:text.index("\n# part: ")])
    kinds = {type(node).__name__ for node in preamble.body[1:]}  # after the docstring
    assert kinds <= {"Import", "ImportFrom", "Assign"}
    copied = "".join(step_function_parts().values())
    assert all(f"def {name}(" in copied for name in ("attention", "linear", "moe", "ring_mask", "layer_norm"))


def test_a_linear_part_without_its_blocks_branch_is_refused():
    with pytest.raises(RuntimeError, match="one Blocks branch"):
        codegen._without_blocks("def linear(x, w, b=None):\n    return x @ w.T\n")
