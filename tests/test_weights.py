"""Weights: NumPy arrays mapped from single and sharded safetensors, and errors that name the tensor."""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from linnet.errors import WeightError
from linnet.model import open_model
from linnet.spec import load_spec
from linnet.weights import load_safetensors


def _copy_checkpoint(src, dst, edit):
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")


def test_sharded_equals_single(checkpoint_dir, tmp_path):
    src = checkpoint_dir("qwen3-gqa3")
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / shard)
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    spec = load_spec(tmp_path)
    sharded, single = load_safetensors(tmp_path, spec), load_safetensors(src, spec)
    assert set(sharded) == set(single)
    assert all(np.array_equal(sharded[k], single[k]) for k in single)


def test_arrays_map_the_file_in_its_dtype(checkpoint_dir):
    import torch
    from safetensors.torch import load_file as load_torch

    path = checkpoint_dir("qwen3-gqa3", "bfloat16")
    weights = open_model(str(path)).weights
    theirs = load_torch(path / "model.safetensors")
    for name in ("embed", "layers.1.q_norm", "layers.0.down"):
        array = weights[name]
        assert array.dtype == ml_dtypes.bfloat16
        assert not array.flags.writeable and not array.flags.owndata  # a view of the read-only map, no copy
    hf = "model.layers.0.mlp.down_proj.weight"
    np.testing.assert_array_equal(weights["layers.0.down"].view(np.int16), theirs[hf].view(torch.int16).numpy())


def test_tied_checkpoint_has_no_separate_head(checkpoint_dir):
    model = open_model(str(checkpoint_dir("qwen2-tied")))
    assert "lm_head" not in model.weights
    assert model.weights.head() is model.weights["embed"]


def test_missing_weight_is_named(checkpoint_dir, tmp_path):
    bad = tmp_path / "bad"
    _copy_checkpoint(checkpoint_dir("llama-gqa3"), bad, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightError, match=r"missing weight 'layers.1.up' \(expected shape \[104, 48\]\)"):
        open_model(str(bad))


def test_misshapen_weight_is_named(checkpoint_dir, tmp_path):
    bad = tmp_path / "bad"

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16]

    _copy_checkpoint(checkpoint_dir("llama-gqa3"), bad, shrink)
    with pytest.raises(WeightError, match=r"'layers.0.k' has shape \[16, 48\], expected \[32, 48\]"):
        open_model(str(bad))


def test_truncated_safetensors_is_a_clear_error(checkpoint_dir, tmp_path):
    bad = tmp_path / "bad"
    _copy_checkpoint(checkpoint_dir("llama-gqa3"), bad, lambda t: None)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightError, match="cannot read .*truncated"):
        open_model(str(bad))


def test_unsupported_dtype_is_named(checkpoint_dir, tmp_path):
    bad = tmp_path / "bad"
    name = "model.layers.0.self_attn.q_proj.weight"
    _copy_checkpoint(checkpoint_dir("llama-gqa3"), bad, lambda t: t.update({name: t[name].astype(np.float64)}))
    with pytest.raises(WeightError, match=rf"tensor '{name}' has dtype F64; Linnet reads F32, F16, BF16"):
        open_model(str(bad))


def test_no_weights_at_all(checkpoint_dir, tmp_path):
    (tmp_path / "config.json").write_text((checkpoint_dir("llama-gqa3") / "config.json").read_text())
    with pytest.raises(WeightError, match="no model.safetensors"):
        open_model(str(tmp_path))
