"""Tokenizer: every EOS id from the three files that may list them, and chat templates."""
from __future__ import annotations

import json
import shutil

import pytest

from linnet.errors import UnsupportedModel
from linnet.tokenizer import load_tokenizer


def test_eos_ids_are_collected_from_every_file(checkpoint_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(checkpoint_dir("qwen2-tied"), model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    tok = load_tokenizer(model)
    # generation_config [2, 3], config.json 2, tokenizer_config's "<|im_end|>" = 4: in order, once each.
    assert tok.eos_ids == (2, 3, 4)


def test_chat_template_renders_with_the_generation_prompt(checkpoint_dir):
    tok = load_tokenizer(checkpoint_dir("qwen2-tied"))
    text = tok.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == tok.hf.token_to_id("<|im_start|>")
    assert tok.decode(ids, skip_special_tokens=False).endswith("assistant\n")


def test_special_tokens_and_bos(checkpoint_dir):
    tok = load_tokenizer(checkpoint_dir("qwen2-tied"))
    assert tok.encode("fox")[0] == 1  # the post-processor adds <s>
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [4]  # a special token is one id


def test_no_template_and_template_errors(checkpoint_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(checkpoint_dir("qwen2-tied"), model)
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(UnsupportedModel, match="no chat template"):
        load_tokenizer(model).render_chat([{"role": "user", "content": "x"}])
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ raise_exception('roles must alternate') }}"}))
    with pytest.raises(UnsupportedModel, match="roles must alternate"):
        load_tokenizer(model).render_chat([{"role": "user", "content": "x"}])
