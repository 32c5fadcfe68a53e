"""Mixtures of experts in GGUF, beyond the f32 round trip every GGUF case takes (``test_gguf_roundtrip``): the
file holds llama.cpp's expert tensors, a GGUF read back and exported to HF runs in transformers to Linnet's
logits, quantised experts load as gguf dequantises them, and what llama.cpp's graphs cannot express is
refused by name.

Quantised experts are dequantised at load, like every quantised tensor Linnet reads as floats: their values
must equal gguf's own quantise-dequantise of the originals, bit for bit.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from gguf_cases import MOE_GGUF_CASE_IDS, rewritten

from linnet.backends import CacheShape, create_runner
from linnet.errors import UnsupportedModel
from linnet.gguf import export as gguf_export
from linnet.gguf.export import export_gguf
from linnet.gguf.format import GGUFFile
from linnet.gguf.reader import load_gguf, spec_from_metadata
from linnet.hf.export import export_hf
from linnet.model import open_model
from linnet.spec import MoeSpec

transformers = pytest.importorskip("transformers")

PROMPT = [1, 17, 250, 3, 99, 42, 7, 300, 12, 5]
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def logits(model) -> np.ndarray:
    return create_runner("reference:numpy", model.weights, CacheShape(1, 32)).prefill(0, PROMPT, all_logits=True)


@pytest.mark.parametrize("case", MOE_GGUF_CASE_IDS)
def test_a_gguf_export_read_back_runs_in_transformers(case, gguf_case_dir, tmp_path):
    """HF -> GGUF -> Linnet -> HF: transformers computes the first checkpoint's logits, within f32 reordering."""
    model = open_model(str(gguf_case_dir(case)))
    path = export_gguf(model, tmp_path / "m.gguf", "f32")
    tensors = GGUFFile(path).tensors
    experts = model.spec.moe.experts
    for part in EXPERTS:  # llama.cpp's stacked experts: [E, F, D] and [E, D, F] in numpy's order
        assert tensors[f"blk.0.{part}"].shape[0] == experts
    assert tensors["blk.0.ffn_gate_inp.weight"].shape == (experts, model.spec.hidden_size)
    out = export_hf(load_gguf(path), tmp_path / "hf", "f32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        theirs = hf.eval()(torch.tensor([PROMPT])).logits[0].numpy()
    np.testing.assert_allclose(theirs, logits(model), atol=1e-4, rtol=0)


def test_qwen2_moe_writes_its_shared_expert_and_reads_llama_cpps_vector_gate(gguf_case_dir, tmp_path):
    model = open_model(str(gguf_case_dir("qwen2moe-shared")))
    path = export_gguf(model, tmp_path / "m.gguf", "f32")
    tensors = GGUFFile(path).tensors
    assert {f"blk.0.ffn_{p}_shexp.weight" for p in ("gate", "up", "down")} <= set(tensors)
    assert tensors["blk.0.ffn_gate_inp_shexp.weight"].shape == (1, model.spec.hidden_size)
    # llama.cpp's converter writes the gate as a vector of hidden_size
    vector = rewritten(path, tmp_path / "v.gguf", lambda name, a: (a.reshape(-1), Q.F32) if "shexp" in name
                       and a.shape[0] == 1 else None)
    assert GGUFFile(vector).tensors["blk.0.ffn_gate_inp_shexp.weight"].shape == (model.spec.hidden_size,)
    np.testing.assert_array_equal(logits(load_gguf(vector)), logits(model))


@pytest.mark.parametrize("case, qtype", [("mixtral-blocks", Q.Q8_0), ("gptoss-blocks", Q.Q8_0),
                                         ("mixtral-blocks", Q.Q4_0), ("mixtral-blocks", Q.Q4_1),
                                         ("gptoss-blocks", Q.MXFP4)], ids=lambda x: getattr(x, "name", x))
def test_quantised_experts_load_as_gguf_dequantises_them(case, qtype, gguf_case_dir, tmp_path):
    """q8_0 from the exporter; the 4-bit forms (and gpt-oss's MXFP4) by storing an f32 export's experts so.
    The routers and biases (the experts' too) stay f32, as llama.cpp's converters keep them."""
    model = open_model(str(gguf_case_dir(case)))
    if qtype == Q.Q8_0:
        path = export_gguf(model, tmp_path / "m.gguf", "q8_0")
    else:
        f32 = export_gguf(model, tmp_path / "f32.gguf", "f32")
        path = rewritten(f32, tmp_path / "m.gguf", lambda name, a: (a, qtype) if name.endswith(EXPERTS) else None)
    types = {name: info.type for name, info in GGUFFile(path).tensors.items()}
    assert {types[f"blk.1.{part}"] for part in EXPERTS} == {qtype}
    assert {t for name, t in types.items() if name.endswith((".bias", "ffn_gate_inp.weight"))} == {Q.F32}
    back = load_gguf(path)
    for name, array in model.weights.items():
        if name.rsplit(".", 1)[-1] in ("expert_gate", "expert_up", "expert_down"):
            np.testing.assert_array_equal(back.weights[name], dequantize(quantize(array, qtype), qtype), err_msg=name)
        elif name.endswith(("router", "bias")):
            np.testing.assert_array_equal(back.weights[name], array, err_msg=name)


def test_a_llama_file_with_experts_is_mixtral(gguf_case_dir, tmp_path):
    model = open_model(str(gguf_case_dir("mixtral-top2of5")))
    meta = GGUFFile(export_gguf(model, tmp_path / "m.gguf", "f32")).metadata
    assert meta["general.architecture"] == "llama" and meta["llama.expert_count"] == 5
    assert meta["llama.expert_used_count"] == 2 and "llama.expert_feed_forward_length" not in meta
    assert load_gguf(tmp_path / "m.gguf").spec.architecture == "MixtralForCausalLM"


def _metadata(model, **changes) -> tuple[dict, dict]:
    spec = model.spec
    meta = {**gguf_export.model_metadata(spec, (2,)), **{f"{spec.family}.{k}": v for k, v in changes.items()}}
    return meta, {name: t[2] for name, t in gguf_export._tensors(spec, model.weights, Q.F32).items()}


@pytest.mark.parametrize("case, change, message", [
    # llama.cpp's graphs of these families weigh the experts their own way
    ("qwen2moe-shared", dict(normalize=True), r"moe.normalize=True \(it would read back as False\)"),
    ("qwen3moe-sparse", dict(normalize=False), r"moe.normalize=False \(it would read back as True\)"),
    ("olmoe-mha", dict(normalize=True), r"moe.normalize=True \(it would read back as False\)"),
    ("gptoss-limit7", dict(limit=0.5), r"moe.limit=0.5 \(it would read back as 7.0\)"),
    ("gptoss-limit7", dict(alpha=1.5), r"moe.alpha=1.5 \(it would read back as 1.702\)"),
])
def test_experts_llama_cpp_weighs_otherwise_are_refused(case, change, message, gguf_case_dir, tmp_path):
    model = open_model(str(gguf_case_dir(case)))
    moe = replace(model.spec.moe, **change)
    with pytest.raises(UnsupportedModel, match=message):
        export_gguf(replace(model, spec=replace(model.spec, moe=moe)), tmp_path / "m.gguf", "f32")
    assert list(tmp_path.iterdir()) == []


def test_a_gpt_oss_without_sliding_layers_is_refused(gguf_case_dir, tmp_path):
    model = open_model(str(gguf_case_dir("gptoss-limit7")))
    spec = replace(model.spec, layer_types=(), sliding_window=None)
    with pytest.raises(UnsupportedModel, match="gpt-oss graph slides every other layer; this model has no sliding"):
        export_gguf(replace(model, spec=spec), tmp_path / "m.gguf", "f32")


@pytest.mark.parametrize("case, change, message", [
    ("mixtral-top2of5", {"expert_weights_scale": 2.5}, r"llama.expert_weights_scale 2.5: Linnet reads the experts' "
                                                       "weights unscaled only"),
    ("qwen3moe-sparse", {"expert_count": 0}, r"qwen3moe.expert_count: expected a positive integer, got 0"),
    ("gptoss-limit7", {"rope.freq_base_swa": 10000.0}, "freq_base_swa differs from rope.freq_base"),
])
def test_expert_metadata_linnet_cannot_read_as_llama_cpp_does_is_named(case, change, message, gguf_case_dir):
    model = open_model(str(gguf_case_dir(case)))
    with pytest.raises(UnsupportedModel, match=message):
        spec_from_metadata(*_metadata(model, **change), {}, "x.gguf")


def test_the_expert_counts_llama_cpps_qwen_graphs_default(gguf_case_dir):
    """Without expert_feed_forward_length, llama.cpp's qwen graphs size each expert feed_forward_length / top k;
    without expert_shared_feed_forward_length, the shared one feed_forward_length."""
    model = open_model(str(gguf_case_dir("qwen2moe-shared")))
    meta, shapes = _metadata(model)
    del meta["qwen2moe.expert_feed_forward_length"], meta["qwen2moe.expert_shared_feed_forward_length"]
    assert spec_from_metadata(meta, shapes, {}, "x.gguf").moe == MoeSpec(6, 3, 104 // 3, shared_size=104)
