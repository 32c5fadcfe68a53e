"""The generated JAX source is a product: pinned by a golden file, standalone, and runnable alone; the
StableHLO modules written beside it run by their calling convention alone.

Regenerate the golden file after an intended change with ``LINNET_UPDATE_GOLDEN=1 pytest tests/backends/xla``.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file

from linnet.backends import CacheShape, create_runner
from linnet.backends.xla.codegen import generate_source
from linnet.backends.xla.layout import xla_program
from linnet.backends.xla.stablehlo_runner import compile_module
from linnet.cli import main as linnet_main
from linnet.model import open_model
from linnet.spec import spec_from_hf_config

GOLDEN = Path(__file__).parent / "golden" / "qwen3_tiny.py"
# Qwen3: q/k norm, head_dim 32 != 48 / 6, GQA ratio 3.
QWEN3_TINY = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 48, "intermediate_size": 104,
    "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,
    "vocab_size": 331, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
}


def test_generated_source_matches_golden():
    source = generate_source(xla_program(spec_from_hf_config(QWEN3_TINY)))
    if os.environ.get("LINNET_UPDATE_GOLDEN"):
        GOLDEN.write_text(source)
    assert source == GOLDEN.read_text()


def test_generated_source_imports_jax_and_numpy_only():
    tree = ast.parse(GOLDEN.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"jax", "numpy"}


def greedy_tokens(model_dir: Path, prompt: list[int], new: int) -> list[int]:
    runner = create_runner("xla:jax", open_model(str(model_dir)).weights, CacheShape(1, 64))
    out = [int(np.argmax(runner.prefill(0, prompt)))]
    while len(out) < new:
        out.append(int(np.argmax(runner.decode([out[-1]])[0])))
    return out


def test_compiled_directory_runs_without_linnet(checkpoint_dir, tmp_path):
    model_dir = checkpoint_dir("qwen3-gqa3")
    out = tmp_path / "compiled"
    assert linnet_main(["compile", str(model_dir), "--target", "jax", "-o", str(out)]) == 0
    result = subprocess.run([sys.executable, "run.py", "1", "5", "7"], cwd=out, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert [int(t) for t in result.stdout.split()] == greedy_tokens(model_dir, [1, 5, 7], 8)


def test_stablehlo_modules_run_by_their_calling_convention(checkpoint_dir, tmp_path):
    """The written modules, fed as calling_convention.json says (no Linnet code but the compile call)."""
    model_dir = checkpoint_dir("qwen2-tied")
    out = tmp_path / "compiled"
    assert linnet_main(["compile", str(model_dir), "--target", "stablehlo", "-o", str(out)]) == 0
    convention = json.loads((out / "calling_convention.json").read_text())
    files = {name: load_file(out / name) for name in ("weights.safetensors", "rope.safetensors")}

    def argument(arg: dict, given: dict) -> np.ndarray:
        if arg["name"] in given:
            return given[arg["name"]]
        if "source" not in arg:  # a cache: zeros
            return np.zeros(arg["shape"], np.float32)
        src = arg["source"]
        array = files[src["file"]][src["tensor"]]
        return array[src["index"]] if "index" in src else array[:arg["shape"][0]]

    modules = convention["modules"]
    prefill, decode = (compile_module((out / modules[name]["file"]).read_text(), name)
                       for name in ("prefill", "decode"))
    prompt, length = [1, 5, 7], modules["prefill"]["sizes"]["T"]
    scratch = modules["prefill"]["sizes"]["P"] - 1
    given = {"tokens": np.array([prompt + [0] * (length - 3)], np.int32),
             "positions": np.array([[0, 1, 2] + [scratch] * (length - 3)], np.int32),
             "rows": np.zeros(1, np.int32), "select": np.array([[2]], np.int32)}
    args = [jax.device_put(argument(a, given)) for a in modules["prefill"]["arguments"]]
    logits, *caches = (r[0] for r in prefill.execute_sharded(args).disassemble_into_single_device_arrays())
    got = [int(np.argmax(logits[0, 0]))]
    names = [a["name"] for a in modules["decode"]["arguments"]]
    while len(got) < 8:
        given = {"tokens": np.array([[got[-1]]], np.int32),
                 "positions": np.array([[len(prompt) + len(got) - 1]], np.int32),
                 "rows": np.zeros(1, np.int32), "select": np.zeros((1, 1), np.int32)}
        args = [caches[names.index(a["name"]) - 4] if a["name"].startswith("cache_")
                else jax.device_put(argument(a, given))
                for a in modules["decode"]["arguments"]]
        logits, *caches = (r[0] for r in decode.execute_sharded(args).disassemble_into_single_device_arrays())
        got.append(int(np.argmax(logits[0, 0])))
    assert got == greedy_tokens(model_dir, prompt, 8)
