"""The ``linnet`` command end to end: run, info, and one-line errors instead of stack traces."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from linnet.cli import main


def test_run_json_on_a_tiny_model(checkpoint_dir, capsys):
    assert main(["run", str(checkpoint_dir("qwen3-gqa3")), "--prompt", "The quick", "--max-new-tokens", "6",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_ids"][0] == 1 and len(out["token_ids"]) <= 6
    assert out["ttft_ms"] > 0 and out["load_s"] > 0 and out["threads"] >= 1 and "load_average" in out


def test_run_streams_text_then_a_summary(checkpoint_dir, capsys):
    assert main(["run", str(checkpoint_dir("qwen3-gqa3")), "--chat", "Hello", "--max-new-tokens", "4",
                 "--temperature", "0.8", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    assert "tok/s" in captured.err and "load" in captured.err and "threads" in captured.err


def test_info_json(checkpoint_dir, capsys):
    assert main(["info", str(checkpoint_dir("llama-gqa3")), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "LlamaForCausalLM" and info["head_dim"] == 16 and info["num_kv_heads"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "/no/such/model", "--prompt", "x"], "no such model file or directory"),
        (["run", "{model}", "--prompt", "x" * 200, "--max-new-tokens", "8", "--cache-positions", "64"], "cache"),
        (["run", "{model}", "--prompt", "x", "--top-p", "0"], "argument --top-p: must be in (0, 1]"),
    ],
)
def test_errors_are_one_line(checkpoint_dir, args, message):
    model = str(checkpoint_dir("qwen3-gqa3"))
    argv = [a.replace("{model}", model) for a in args]
    result = subprocess.run([sys.executable, "-m", "linnet", *argv], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.startswith("linnet: error: ") and message in result.stderr
    assert "Traceback" not in result.stderr


def test_unsupported_architecture_is_named(checkpoint_dir, tmp_path):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(checkpoint_dir("qwen3-gqa3"), model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, "-m", "linnet", "info", str(model)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2 and "architecture 'DeepseekV3ForCausalLM' is not supported" in result.stderr


def test_compile_prints_the_program(checkpoint_dir, capsys):
    assert main(["compile", str(checkpoint_dir("llama-mqa-tied-rope3")), "--target", "program"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# LlamaForCausalLM: 2 layers")
    assert "cache_k_out = cache_write(cache_k, rows, positions, k_rot)" in text
    assert "logits = cast(logits_act; dtype='f32')" in text and "lm_head: f32[331, 48]" in text


def test_reference_backend_runs_from_the_command_line(checkpoint_dir, capsys):
    assert main(["run", str(checkpoint_dir("qwen2-tied")), "--prompt", "The quick", "--max-new-tokens", "5",
                 "--backend", "reference:numpy", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) <= 5
    assert main(["run", str(checkpoint_dir("qwen2-tied")), "--prompt", "x", "--backend", "reference:numpy",
                 "--dtype", "bf16"]) == 2
    assert "reference:numpy does not run bf16; it runs f32" in capsys.readouterr().err


def test_run_picks_onnx_runtime_on_a_cpu_in_f32(checkpoint_dir, capsys):
    """Without --backend: onnx:cpu where ONNX Runtime is installed and there is no GPU, in f32; in a
    16-bit dtype its graphs would round after every op, so torch runs those."""
    pytest.importorskip("onnxruntime")
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU: torch's backends come first")
    model = str(checkpoint_dir("qwen3-gqa3"))
    assert main(["run", model, "--prompt", "The quick", "--max-new-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"] == "onnx:cpu"
    assert main(["run", model, "--prompt", "The quick", "--max-new-tokens", "3", "--json", "--dtype", "bf16"]) == 0
    assert json.loads(capsys.readouterr().out)["backend"].startswith("torch:")


def test_info_reports_the_cache_bytes_of_a_row(checkpoint_dir, capsys):
    import json

    from linnet.cli import main

    assert main(["info", str(checkpoint_dir("gemma2-softcap-window6")), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    # 2 layers x keys and values x 2 kv heads x head_dim 16 x 256 positions x 4 bytes (f32)
    assert info["kv_cache_bytes_per_row"] == 2 * 2 * 2 * 16 * 256 * 4
    assert info["layer_types"] == ["sliding", "full"] and info["sliding_window"] == 6


def test_info_counts_a_sliding_layers_ring(checkpoint_dir, capsys, monkeypatch):
    import json

    from linnet.backends.runner import Runner
    from linnet.cli import main

    monkeypatch.setattr(Runner, "prefill_chunk", 4)  # rings of 6 + 4 - 1 slots, fewer than 256 positions
    assert main(["info", str(checkpoint_dir("gemma2-softcap-window6")), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kv_cache_bytes_per_row"] == 2 * 2 * 16 * (9 + 256) * 4  # the sliding layer's 9, the full one's 256
