"""The torch runner on a CPU: f32 products on weights re-laid for oneDNN at load (eager: instead of the
plain ones; inductor serving several rows: beside them), several rows in one step reading consecutive
cache rows as views, and attention that reads no further than the step's last real position."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from linnet.backends import CacheShape, Decode, Prefill, create_runner
from linnet.model import open_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@pytest.fixture(scope="module")
def weights(checkpoint_dir):
    return open_model(str(checkpoint_dir("qwen2-tied"))).weights  # tied: the head is the embedding


def test_eager_packs_every_product_weight_and_keeps_the_embedding(weights):
    model = create_runner("torch:eager", weights, CacheShape(2, 64)).model
    products = [getattr(layer, name) for layer in model.layers for name in ("qkv", "o", "gate_up", "down")]
    assert all(w.is_mkldnn for w in products) and model.lm_head.is_mkldnn
    assert not model.embed.is_mkldnn  # the lookups read the table as it is


def test_rows_in_any_order_give_the_tokens_they_give_alone(weights):
    """Consecutive rows go through cache views, others through copies: both give each row's own tokens."""
    prompts = {row: list(np.random.RandomState(row).randint(5, 300, size=3 + 2 * row)) for row in range(5)}

    def run(rows: list[int], steps: int = 4) -> dict[int, list[int]]:
        runner = create_runner("torch:eager", weights, CacheShape(5, 64))  # decode sizes 1, 4, 5
        out = {row: [runner.step(prefill=[Prefill(row, prompts[row])])[row].token] for row in rows}
        for _ in range(steps):
            results = runner.step(decode=[Decode(row, out[row][-1]) for row in rows])
            for row in rows:
                out[row].append(results[row].token)
        return out

    alone = {row: run([row])[row] for row in prompts}
    assert run([0, 1, 2, 3, 4]) == alone  # one window of consecutive rows
    assert run([0, 2, 4]) == {row: alone[row] for row in (0, 2, 4)}  # padded with row 1: rows 0, 1, 2, 4


def test_idle_rows_do_not_widen_eager_attention(weights, monkeypatch):
    """Idle rows pad a step at the scratch position, the model's last: eager attention reads up to the
    last position a real row is at, not the whole cache."""
    runner = create_runner("torch:eager", weights, CacheShape(4, 64))  # decode sizes 1, 4
    assert runner.scratch_position == runner.model.key_positions.shape[0] - 1 >= 64
    first = runner.step(prefill=[Prefill(0, [5, 6, 7])])[0].token
    module, seen = sys.modules[type(runner.model).__module__], []  # the generated source's module
    attention = module.attention
    monkeypatch.setattr(module, "attention", lambda q, k, v, rows, mask, *attrs, **named:
                        seen.append(mask.shape[-1]) or attention(q, k, v, rows, mask, *attrs, **named))
    runner.step(decode=[Decode(0, first), Decode(2, first)])  # padded to 4 rows with rows 1 and 3
    assert set(seen) == {4}  # row 0 at position 3, row 2 at 0: four keys in every layer


def test_compiled_steps_of_several_rows_carry_relaid_weights(weights):
    """inductor's one-row products stream the plain weights; its products of several rows take the
    re-laid copy each weight carries. A one-row runner keeps the plain ones only."""
    model = create_runner("torch:inductor", weights, CacheShape(4, 64)).model
    products = [getattr(layer, name) for layer in model.layers for name in ("qkv", "o", "gate_up", "down")]
    assert all(not w.is_mkldnn and w.onednn.is_mkldnn for w in [*products, model.lm_head])
    assert model.lm_head is model.embed  # tied: the table itself carries the head's copy
    one_row = create_runner("torch:inductor", weights, CacheShape(1, 64)).model
    assert not hasattr(one_row.layers[0].qkv, "onednn")


def test_a_compiled_step_reads_no_cache_position_past_its_span(weights):
    """The compiled prompt and decode steps attend up to the step's last real position: positions past
    it (4 and on, for every row) hold NaN here, which any read of them would carry into the logits."""
    clean = create_runner("torch:inductor", weights, CacheShape(4, 64))
    poisoned = create_runner("torch:inductor", weights, CacheShape(4, 64))
    for cache in (*poisoned.model.cache_k, *poisoned.model.cache_v):
        cache[:, :, 4:] = float("nan")
    results = []
    for runner in (clean, poisoned):
        prompt = runner.step(prefill=[Prefill(0, [5, 6, 7]), Prefill(2, [8])], logits=True)
        decode = runner.step(decode=[Decode(0, prompt[0].token), Decode(2, prompt[2].token)], logits=True)
        results.append([r.logits for r in (prompt[0], prompt[2], decode[0], decode[2])])
    for got, expected in zip(*results[::-1]):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_a_16bit_run_keeps_its_cache_as_narrow_as_its_weights(weights, dtype):
    """16-bit weights under f32 arithmetic: keys and values rounded to 16 bits where they are written (half
    the bytes a decode step reads from the cache), and the bytes a row holds reported so."""
    f32 = create_runner("torch:eager", weights, CacheShape(1, 64))
    runner = create_runner("torch:eager", weights, CacheShape(1, 64), dtype)
    narrow = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    assert {c.dtype for c in (*runner.model.cache_k, *runner.model.cache_v)} == {narrow}
    assert runner.describe()["arithmetic"] == "f32" and runner.describe()["kv_cache_dtype"] == dtype
    assert 2 * runner.cache_bytes_per_row == f32.cache_bytes_per_row
    prompt = list(np.random.RandomState(0).randint(5, 300, size=9))
    token = runner.step(prefill=[Prefill(0, prompt)])[0].token
    runner.step(decode=[Decode(0, token)])
    written = runner.model.cache_k[0][0, :, :10]
    f32.step(prefill=[Prefill(0, prompt)])
    f32.step(decode=[Decode(0, token)])
    # the same keys as the f32 run's within the weights' rounding, stored in 16 bits
    wide = f32.model.cache_k[0][0, :, :10]
    assert written.abs().max() > 0 and torch.allclose(written.float(), wide, atol=0.05 * float(wide.abs().max()))
