"""The ONNX backend's files and loads: `linnet compile --target onnx` writes graphs that onnx's full check
accepts and a plain onnxruntime.InferenceSession runs to the NumPy reference's logits; a provider
missing a kernel is named at load; GPU providers report themselves unavailable here; past 2 GB works.
(Parity with transformers in every dtype is the conformance suite's, which runs onnx:cpu.)"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from linnet.backends import CacheShape, create_runner
from linnet.backends.onnx import runner as onnx_runner
from linnet.backends.onnx.graph import GraphOptions
from linnet.backends.registry import get_backend
from linnet.cli import main
from linnet.errors import LinnetError
from linnet.model import open_model
from linnet.weights import Weights

CASE = "qwen3-gqa3"  # q/k norm, GQA 3, head_dim 32 != hidden / heads


def step_feeds(spec, tokens: list[int], rows: int = 2, positions: int = 16, dtype=np.float32) -> dict:
    feeds = {"tokens": np.array([tokens]), "positions": np.arange(len(tokens))[None], "rows": np.array([1]),
             "select": np.arange(len(tokens))[None]}
    cache = np.zeros((rows, spec.num_kv_heads, positions, spec.head_dim), dtype)
    for i in range(spec.num_layers):
        feeds[f"cache_k.{i}"], feeds[f"cache_v.{i}"] = cache, cache
    return feeds


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_compiled_files_pass_the_full_check_and_run_in_a_plain_session(checkpoint_dir, tmp_path, capsys, dtype):
    out = tmp_path / "onnx"
    assert main(["compile", str(checkpoint_dir(CASE)), "--target", "onnx", "-o", str(out), "--dtype", dtype]) == 0
    assert "model.onnx" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.ort.onnx", "weights.bin"]
    assert (out / "model.onnx").stat().st_size < 100_000  # the weights are external data
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)  # reads the external data too
    if dtype == "bf16":
        return  # the CPU provider has no bfloat16 products (see test_a_missing_kernel_is_named_at_load)

    model = open_model(str(checkpoint_dir(CASE)))
    tokens = [5, 17, 101, 42, 250, 7]
    want = create_runner("reference:numpy", model.weights, CacheShape(2, 15)).prefill(1, tokens, all_logits=True)
    tolerance = 1e-4 if dtype == "f32" else 0.01 * np.abs(want).max()
    for graph in ("model.onnx", "model.ort.onnx"):
        session = ort.InferenceSession(str(out / graph), providers=["CPUExecutionProvider"])
        logits, ids, *caches = session.run(None, step_feeds(model.spec, tokens, dtype=np.dtype(dtype.replace("f", "float"))))
        assert logits.shape == (1, len(tokens), model.spec.vocab_size) and logits.dtype == np.float32
        assert np.abs(logits[0] - want).max() <= tolerance, graph
        assert (ids == logits.argmax(-1)).all()
        assert np.abs(caches[0][1, :, :len(tokens)]).max() > 0 and not caches[0][0].any()  # row 1 written, row 0 not


def test_a_missing_kernel_is_named_at_load(checkpoint_dir, monkeypatch):
    # A true bfloat16 graph on the CPU provider, which has no bfloat16 Gemm (the backend's own CPU graph
    # holds bfloat16 values in float32 for this reason): the load names the op and what runs instead.
    monkeypatch.setattr(onnx_runner, "graph_options", lambda mode, dtype: GraphOptions("plain"))
    weights = open_model(str(checkpoint_dir(CASE))).weights
    with pytest.raises(LinnetError, match=r"CPUExecutionProvider has no bf16 kernel for \w+ .*--dtype f32 or f16"):
        create_runner("onnx:cpu", weights, CacheShape(1, 16), dtype="bf16")


@pytest.mark.parametrize("backend", ["onnx:cuda", "onnx:tensorrt"])
def test_gpu_providers_say_why_they_cannot_run(backend):
    if get_backend(backend).unavailable() is None:
        pytest.skip(f"{backend} runs here: the GPU check script covers it")
    assert "ExecutionProvider" in get_backend(backend).unavailable()
    with pytest.raises(LinnetError, match=f"{backend} cannot run here: this onnxruntime has no"):
        create_runner(backend, None, CacheShape(1, 16))


def test_a_greedy_step_brings_back_ids_from_the_graph(checkpoint_dir):
    runner = create_runner("onnx:cpu", open_model(str(checkpoint_dir(CASE))).weights, CacheShape(2, 32))
    out = runner._forward(np.array([[3, 9, 27]]), np.array([[0, 1, 2]]), np.array([0]), None)
    assert (out.ids == out.logits.numpy().argmax(-1)).all()  # the graph's ArgMax, not the host's


@pytest.mark.slow
def test_weights_past_2_gb_export_and_load(tmp_path):
    from linnet.spec import spec_from_hf_config

    spec = spec_from_hf_config(dict(
        architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=2048, intermediate_size=5632,
        num_hidden_layers=10, num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False))
    from linnet.names import expected_shapes

    rng = np.random.default_rng(0)
    arrays = {name: (rng.standard_normal(shape, dtype=np.float32) * 0.02 if len(shape) == 2 else
                     np.ones(shape, np.float32)) for name, shape in expected_shapes(spec).items()}
    assert sum(a.nbytes for a in arrays.values()) > 2**31
    runner = create_runner("onnx:cpu", Weights(spec, arrays), CacheShape(1, 16))
    tokens = [1, 2, 3]
    got = runner.prefill(0, tokens)
    want = create_runner("reference:numpy", Weights(spec, arrays), CacheShape(1, 16)).prefill(0, tokens)
    assert np.abs(got - want).max() <= 1e-4
