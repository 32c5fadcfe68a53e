"""Cache sizes are bucketed, so that a compiled step serves nearby lengths (another --max-new-tokens)."""
from __future__ import annotations

import numpy as np

from linnet.backends import CacheShape, create_runner
from linnet.model import open_model


def test_nearby_cache_lengths_share_one_shape(checkpoint_dir):
    weights = open_model(str(checkpoint_dir("qwen2-tied"))).weights
    runners = [create_runner("torch:eager", weights, CacheShape(1, n)) for n in (100, 200, 256)]
    assert {r.model.cache_k[0].shape[2] for r in runners} == {257}  # 256 positions and the scratch one
    assert create_runner("torch:eager", weights, CacheShape(1, 257)).model.cache_k[0].shape[2] == 513
    logits = [r.prefill(0, [3, 5, 7, 9]) for r in runners]
    assert all(np.array_equal(logits[0], other) for other in logits[1:])
    assert runners[0].decode([11]).shape == (1, weights.spec.vocab_size)
