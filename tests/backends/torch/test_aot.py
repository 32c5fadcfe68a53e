"""torch:inductor on a CPU keeps its compiled steps as AOTInductor packages: a second runner (as a new
process would) loads them instead of compiling, with the same logits; a package that does not load is
rebuilt with a note."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from linnet.backends import CacheShape, create_runner
from linnet.model import open_model
from linnet.weight_cache import cache_root

pytestmark = pytest.mark.slow  # each package is an inductor compile and a C++ build


def _logits(runner) -> tuple[np.ndarray, np.ndarray]:
    runner.warm_up()
    prompt = runner.prefill(0, list(range(3, 12)))
    return np.asarray(prompt), np.asarray(runner.decode([5]))


def test_a_second_runner_loads_the_packages(checkpoint_dir, capfd):
    weights = open_model(str(checkpoint_dir("qwen2-tied"))).weights
    first = create_runner("torch:inductor", weights, CacheShape(rows=1, positions=48))
    assert not first.compiled_on_disk()
    expected = _logits(first)
    assert "compiling the decode step" in capfd.readouterr().err
    second = create_runner("torch:inductor", weights, CacheShape(rows=1, positions=48))
    assert second.compiled_on_disk()
    got = _logits(second)
    assert "compiling" not in capfd.readouterr().err  # loaded, not compiled
    assert second.compile_time < first.compile_time
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)  # the same code on the same weights


def test_a_corrupt_package_is_rebuilt(checkpoint_dir, capfd):
    weights = open_model(str(checkpoint_dir("llama-gqa3"))).weights
    expected = _logits(create_runner("torch:inductor", weights, CacheShape(rows=1, positions=32)))
    packages = sorted((cache_root() / "compiled").glob("*/step.pt2"))
    for package in packages:
        package.write_bytes(b"not a package")
    capfd.readouterr()
    got = _logits(create_runner("torch:inductor", weights, CacheShape(rows=1, positions=32)))
    err = capfd.readouterr().err
    assert "did not load" in err and "compiling it again" in err
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


def _tensors_alive() -> list[torch.Tensor]:
    gc.collect()
    return [t for t in gc.get_objects() if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"]


def test_compiling_the_steps_keeps_no_copy_of_the_weights(checkpoint_dir):
    """Inductor's AOT compile clones a program's buffers (and its export globals keep the clones), not its
    parameters: the weights are parameters while a step is exported, and buffers, the same tensors, after.
    What the compile leaves alive may alias a weight, but holds none of a weight's shape in memory of its own."""
    weights = open_model(str(checkpoint_dir("qwen2-tied"))).weights
    runner = create_runner("torch:inductor", weights, CacheShape(rows=1, positions=48))
    before = dict(runner.model.named_buffers(remove_duplicate=False))
    earlier = _tensors_alive()  # held, so that no new tensor takes one of their ids
    _logits(runner)  # compiles the prompt and decode steps
    after = dict(runner.model.named_buffers(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[name] is before[name] for name in before)
    assert runner.model.lm_head is runner.model.embed  # the tied head is the embedding still
    assert not list(runner.model.parameters())
    seen = {id(t) for t in earlier}
    storages = {w.untyped_storage().data_ptr() for w in before.values()}
    new = [t for t in _tensors_alive() if id(t) not in seen and t.untyped_storage().data_ptr() not in storages]
    large = {name: w for name, w in before.items() if w.numel() >= 1024}
    assert large
    copied = [name for name, w in large.items() if any(t.shape == w.shape and t.dtype == w.dtype for t in new)]
    assert copied == []
