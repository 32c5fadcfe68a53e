"""The generated PyTorch source is a product: pinned by golden files, standalone, and runnable alone.

Regenerate the golden files after an intended change with ``LINNET_UPDATE_GOLDEN=1 pytest tests/backends/torch``.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from linnet.backends import CacheShape, create_runner
from linnet.backends.torch.codegen import generate_source
from linnet.backends.torch.runner import torch_program
from linnet.cli import main as linnet_main
from linnet.model import open_model
from linnet.spec import spec_from_hf_config

GOLDEN = Path(__file__).parent / "golden"
SPECS = {
    # Qwen3: q/k norm, head_dim 32 != 48 / 6, GQA ratio 3.
    "qwen3_tiny": {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 48, "intermediate_size": 104,
        "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 331, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    },
    # Llama with llama3 rope scaling and biases on q, k, v, o.
    "llama3_tiny": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 300,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "attention_bias": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    },
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_generated_source_matches_golden(name):
    source = generate_source(torch_program(spec_from_hf_config(SPECS[name])))
    golden = GOLDEN / f"{name}.py"
    if os.environ.get("LINNET_UPDATE_GOLDEN"):
        golden.write_text(source)
    assert source == golden.read_text()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_generated_source_imports_torch_only(name):
    tree = ast.parse((GOLDEN / f"{name}.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"torch"}


def test_compiled_directory_runs_without_linnet(checkpoint_dir, tmp_path):
    model_dir = checkpoint_dir("qwen3-gqa3")
    out = tmp_path / "compiled"
    assert linnet_main(["compile", str(model_dir), "-o", str(out)]) == 0
    # The loader runs in a fresh interpreter from the output directory (its imports: see the test above).
    result = subprocess.run([sys.executable, "run.py", "1", "5", "7"], cwd=out, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    runner = create_runner("torch:eager", open_model(str(model_dir)).weights, CacheShape(1, 64))
    logits = runner.prefill(0, [1, 5, 7])
    expected = [int(np.argmax(logits))]
    for _ in range(7):
        expected.append(int(np.argmax(runner.decode([expected[-1]])[0])))
    assert [int(t) for t in result.stdout.split()] == expected


def test_norm_weights_are_folded_into_the_matrices(checkpoint_dir):
    """Layer matrices and an untied head get their norm's weight; a tied head keeps the embedding's."""
    import torch

    from linnet.backends.torch.runner import torch_weights

    for case, tied in (("qwen2-tied", True), ("qwen3-gqa3", False)):
        weights = open_model(str(checkpoint_dir(case))).weights
        w = {name: torch.from_numpy(np.array(a, dtype=np.float32)) for name, a in weights.items()}
        program = torch_program(weights.spec)
        tensors = torch_weights(weights, program)
        qkv = torch.cat([w[f"layers.1.{p}"] for p in ("q", "k", "v")])
        assert torch.equal(tensors["layers.1.qkv"], qkv * w["layers.1.attn_norm"])
        assert not any(name.endswith(("attn_norm", "mlp_norm")) for name in tensors)
        assert torch.equal(tensors["embed"], w["embed"])
        if tied:
            assert "lm_head" not in tensors and "norm" in tensors
            assert 'register_buffer("lm_head", self.embed' in generate_source(program)
        else:
            assert torch.equal(tensors["lm_head"], w["lm_head"] * w["norm"])
            assert "norm" not in tensors


def test_onednn_product_widens_16_bit_weights_safely_across_threads():
    """The generated module's oneDNN product (prompts, several rows) against x @ w.T: f32 weights, and
    16-bit ones widened into a kept buffer, from four threads at once (each needs its own widening)."""
    import threading

    import torch

    from linnet.backends.torch.runner import load_generated_module

    module = load_generated_module(generate_source(torch_program(spec_from_hf_config(SPECS["qwen3_tiny"]))))
    generator = torch.Generator().manual_seed(0)
    cases = [(torch.randn(7, 96, generator=generator), torch.randn(out, 96, generator=generator).to(dtype))
             for out, dtype in ((300, torch.float16), (200, torch.bfloat16), (100, torch.float32),
                                (400, torch.float16))]
    errors: list[float] = []

    def work(x, w):
        for _ in range(200):
            errors.append((module.matmul_t(x, w) - x @ w.float().T).abs().max().item())

    threads = [threading.Thread(target=work, args=case) for case in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 800 and max(errors) < 1e-4


def test_every_op_is_emitted_natively_or_through_its_decomposition():
    from linnet.backends.torch.codegen import NATIVE_OPS
    from linnet.program.ops import uncovered

    assert uncovered(set(NATIVE_OPS)) == []


def test_each_layer_kind_gets_its_function_and_its_mask(checkpoint_dir):
    """Gemma 2: sliding and full layers in turn, each kind one function, the sliding one given the windowed
    mask; the attention's scale and softcap are the program's."""
    source = generate_source(torch_program(open_model(str(checkpoint_dir("gemma2-softcap-window6"))).spec))
    assert 'LAYER_KINDS = ("sliding", "full")' in source
    assert "def layer_sliding(" in source and "def layer_full(" in source and "def layer(" not in source
    assert "window6_mask = mask & (keys > positions[..., None] - 6)[:, None]" in source
    assert 'kinds = {"sliding": (layer_sliding, window6_mask), "full": (layer_full, mask)}' in source
    assert "rows, mask, 0.2041241452319315, softcap=2.0)" in source


def test_an_attention_attr_the_emitter_does_not_know_is_an_error():
    from dataclasses import replace

    from linnet.errors import LinnetError

    program = torch_program(spec_from_hf_config(SPECS["llama3_tiny"]))
    ops = tuple(replace(op, attrs={**op.attrs, "alibi": True}) if op.kind == "attention" else op
                for op in program.layer.ops)
    with pytest.raises(LinnetError, match="alibi"):
        generate_source(replace(program, kinds={"full": replace(program.layer, ops=ops)}))


@pytest.mark.parametrize("case", ["gemma2-softcap-window6", "gptneox-parallel"])
def test_decomposed_composites_give_the_native_ones_logits(checkpoint_dir, case):
    """The primitives the composites decompose into (LayerNorm's mean, sub, rsqrt, shift; softcap's scale
    and tanh; swiglu's activation and mul), emitted in place of the native forms."""
    import torch

    from linnet.backends.torch.codegen import NATIVE_OPS
    from linnet.backends.torch.runner import load_generated_module, torch_weights
    from linnet.program import lower
    from linnet.rope import rope_tables

    weights = open_model(str(checkpoint_dir(case))).weights
    program = torch_program(weights.spec)
    primitive = lower(program, NATIVE_OPS - {"layer_norm", "softcap", "swiglu"})
    tokens = torch.tensor([[5, 9, 3, 7, 11, 2, 8, 4]])
    positions = torch.arange(8)[None]
    logits = []
    for p in (program, primitive):
        cos, sin = rope_tables(weights.spec, 16)
        model = load_generated_module(generate_source(p)).Model(
            torch_weights(weights, p), torch.from_numpy(cos), torch.from_numpy(sin), 1, torch.float32)
        with torch.inference_mode():
            logits.append(model(tokens, positions, torch.tensor([0])))
    kinds = [{op.kind for section in q.sections().values() for op in section.ops} for q in (program, primitive)]
    assert kinds[0] & {"layer_norm", "softcap", "swiglu"} and not kinds[1] & {"layer_norm", "softcap", "swiglu"}
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)
