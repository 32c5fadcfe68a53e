"""The host definition of sampling (backends that sample on a device are checked in the conformance suite)."""
from __future__ import annotations

import numpy as np
import pytest

from linnet.errors import LinnetError
from linnet.sampling import Sampling, sample_host

LOGITS = np.array([1.0, 3.0, 2.9, -1.0, 0.5], dtype=np.float32)


def draws(sampling: Sampling, n: int = 400) -> list[int]:
    rng = np.random.default_rng(sampling.seed)
    return [sample_host(LOGITS, sampling, rng) for _ in range(n)]


def test_greedy_takes_the_argmax():
    assert set(draws(Sampling(), 5)) == {1}
    assert set(draws(Sampling(temperature=1.0, top_k=1), 5)) == {1}


def test_seed_reproduces_and_differs():
    a = draws(Sampling(temperature=1.0, seed=7))
    assert a == draws(Sampling(temperature=1.0, seed=7))
    assert a != draws(Sampling(temperature=1.0, seed=8))
    assert len(set(a)) == 5  # at temperature 1 every token shows up in 400 draws


def test_top_k_and_top_p_restrict_the_choice():
    assert set(draws(Sampling(temperature=1.0, top_k=2, seed=0))) == {1, 2}
    # p(1) ~ 0.45, p(2) ~ 0.41: top_p 0.5 keeps exactly those two, 0.3 keeps only the first.
    assert set(draws(Sampling(temperature=1.0, top_p=0.5, seed=0))) == {1, 2}
    assert set(draws(Sampling(temperature=1.0, top_p=0.3, seed=0))) == {1}


def test_low_temperature_sharpens():
    hot = draws(Sampling(temperature=5.0, seed=1))
    cold = draws(Sampling(temperature=0.05, seed=1))
    assert cold.count(1) > hot.count(1)



def test_the_smallest_temperature_is_all_but_greedy():
    """5e-324 overflowed the scores to inf and the probabilities to NaN (a 500 from the server's fuzzer)."""
    assert set(draws(Sampling(temperature=5e-324, seed=0), 20)) == {1}


def test_the_torch_draw_takes_the_smallest_temperature():
    torch = pytest.importorskip("torch")
    from linnet.backends.torch.runner import draw

    generator = torch.Generator().manual_seed(0)
    picks = {int(draw(torch.from_numpy(LOGITS), Sampling(temperature=5e-324), generator)) for _ in range(20)}
    assert picks == {1}


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_parameters_are_named(kwargs):
    with pytest.raises(LinnetError, match=next(iter(kwargs))):
        Sampling(**kwargs)
