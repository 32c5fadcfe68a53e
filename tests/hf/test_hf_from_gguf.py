"""The default model, a Q4_1 GGUF, exported to HF: transformers computes the logits Linnet computes.

This covers what the tiny checkpoints cannot: a real llama.cpp file (its q/k row order undone, its
smollm pre-tokenizer, its chat template) arriving in transformers intact. Both sides run f32 on the
same dequantised weights; SmolLM2's logits reach ~30, so 1e-3 absolute is f32 reordering, not error.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from linnet.backends import CacheShape, create_runner
from linnet.default_model import DEFAULT_MODEL
from linnet.hf.export import export_hf
from linnet.model import open_model

transformers = pytest.importorskip("transformers")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_export_runs_in_transformers(tmp_path):
    model = open_model(DEFAULT_MODEL)
    out = export_hf(model, tmp_path / "smollm2", "f32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompt = model.tokenizer.encode_chat(QUESTION)
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert tokenizer(text)["input_ids"] == prompt

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0].numpy()
    ours = create_runner("reference:numpy", model.weights, CacheShape(1, 64)).prefill(0, prompt, all_logits=True)
    np.testing.assert_allclose(theirs, ours, atol=1e-3, rtol=0)
    assert tokenizer.decode(hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):],
                            skip_special_tokens=True).startswith("The capital of France is Paris")
