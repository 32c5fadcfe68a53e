"""HF checkpoint -> ``export_gguf`` -> ``load_gguf``: the same model comes back, for every family (a
Mistral comes back as the Llama it is without its window: GGUF has one ``llama`` form for both).

f32, f16 and bf16 are exact conversions, so the weights read back equal the originals rounded to that
type, bit for bit, and f32 logits are identical. q8_0 rounds each weight to 1/127 of its block's largest
magnitude (~0.5% of a weight's spread, 4-5x bf16's rounding), so the weights read back must equal gguf's
own quantise-dequantise of the originals exactly, and the logits stay within 5% of the largest logit
(measured on three seeds of this random model: 2.7-3.7%; bf16 on the same models: 0.8-1.8%).
"""
from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from checkpoints import Case, build_checkpoint
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize, quantize
from gguf_cases import GGUF_CASE_IDS

from linnet.backends import CacheShape, create_runner
from linnet.gguf.export import export_gguf
from linnet.gguf.format import GGUFFile
from linnet.gguf.reader import load_gguf
from linnet.model import open_model
from linnet.spec import ModelSpec

PROMPT = [1, 17, 250, 3, 99, 42, 7, 300, 12, 5]
# Rows of 64 and 128 are whole q8_0 blocks of 32 (the shared cases' rows of 48 are not); Llama's q and k rows
# are permuted in the file, Phi-3's q, k, v and gate, up packed.
Q8_SHAPES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 tie_word_embeddings=False)
Q8_CASES = [Case("llama-q8", "LlamaForCausalLM", Q8_SHAPES), Case("phi3-q8", "Phi3ForCausalLM", Q8_SHAPES)]


def logits(model) -> np.ndarray:
    return create_runner("reference:numpy", model.weights, CacheShape(1, 32)).prefill(0, PROMPT, all_logits=True)


def as_gguf_reads(spec: ModelSpec) -> ModelSpec:
    """Mistral's and Mixtral's GGUF form (llama's) has no layer types; Mistral's reads back as Llama."""
    if spec.architecture == "MixtralForCausalLM":
        return replace(spec, layer_types=(), sliding_window=None)
    if spec.architecture != "MistralForCausalLM":
        return spec
    return replace(spec, architecture="LlamaForCausalLM", layer_types=(), sliding_window=None)


@pytest.mark.parametrize("case", GGUF_CASE_IDS)
def test_f32_round_trip_is_exact(case, gguf_case_dir, tmp_path):
    model = open_model(str(gguf_case_dir(case)))
    back = load_gguf(export_gguf(model, tmp_path / "m.gguf", "f32", name="tiny"))  # a name llama.cpp takes as is

    # the tokenizer's EOS ids join the spec's
    assert back.spec == as_gguf_reads(replace(model.spec, eos_token_ids=model.eos_ids))
    for name, array in model.weights.items():
        np.testing.assert_array_equal(back.weights[name], array, err_msg=name)
    np.testing.assert_array_equal(logits(back), logits(model))

    text = "The quick brown fox, Héllo wörld ✓ 日本語 123."
    assert back.tokenizer.encode(text) == model.tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi there"}]
    assert back.tokenizer.encode_chat(messages) == model.tokenizer.encode_chat(messages)
    assert back.tokenizer.decode(model.tokenizer.encode(text)) == text


@pytest.mark.parametrize("kind, dtype", [("f16", np.float16), ("bf16", ml_dtypes.bfloat16)])
def test_16_bit_exports_round_exactly(kind, dtype, checkpoint_dir, tmp_path):
    model = open_model(str(checkpoint_dir("llama-gqa3")))
    back = load_gguf(export_gguf(model, tmp_path / "m.gguf", kind))
    for name, array in model.weights.items():
        expected = array if array.ndim == 1 else array.astype(dtype).astype(np.float32)  # vectors stay f32
        np.testing.assert_array_equal(back.weights[name], expected, err_msg=name)


def test_bf16_checkpoint_exports_its_bits(checkpoint_dir, tmp_path):
    model = open_model(str(checkpoint_dir("qwen2-tied", "bfloat16")))
    back = load_gguf(export_gguf(model, tmp_path / "m.gguf", "bf16"))
    for name, array in model.weights.items():
        np.testing.assert_array_equal(back.weights[name], array.astype(np.float32), err_msg=name)


@pytest.mark.parametrize("case", Q8_CASES, ids=lambda c: c.id)
def test_q8_0_export(case, tmp_path):
    model = open_model(str(build_checkpoint(case, tmp_path / "hf")))
    path = export_gguf(model, tmp_path / "m.gguf", "q8_0")
    types = {name: info.type for name, info in GGUFFile(path).tensors.items()}
    assert types["blk.0.attn_output.weight"] == types["token_embd.weight"] == types["output.weight"] == Q.Q8_0
    assert types["blk.0.attn_norm.weight"] == Q.F32

    back = load_gguf(path)
    for name, array in model.weights.items():  # q and k rows were permuted, packs stacked: rows, not blocks, move
        expected = array if array.ndim == 1 else dequantize(quantize(array, Q.Q8_0), Q.Q8_0)
        np.testing.assert_array_equal(back.weights[name], expected, err_msg=name)
        if array.ndim == 2:  # the file's blocks, cut and reordered as the floats are
            assert back.weights.blocks[name][0] == "q8_0"
            np.testing.assert_array_equal(dequantize(back.weights.blocks[name][1], Q.Q8_0), expected, err_msg=name)
    ours, theirs = logits(model), logits(back)
    assert np.abs(ours - theirs).max() < 0.05 * np.abs(ours).max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.9


def test_header_reader_agrees_with_gguf_package(checkpoint_dir, tmp_path):
    path = export_gguf(open_model(str(checkpoint_dir("qwen2-tied"))), tmp_path / "m.gguf", "f16")
    ours, theirs = GGUFFile(path), GGUFReader(path)
    fields = {key: field.contents() for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert ours.metadata == fields
    assert len(ours.tensors) == len(theirs.tensors)
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert (info.type, info.shape, info.offset, info.nbytes) == \
            (t.tensor_type, tuple(int(d) for d in reversed(t.shape)), t.data_offset, t.n_bytes)
        np.testing.assert_array_equal(ours.raw(t.name).reshape(-1), t.data.view(np.uint8).reshape(-1))
