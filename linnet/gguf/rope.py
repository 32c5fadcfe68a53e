"""Rotary embedding as GGUF stores it.

Llama 3 rope scaling is a ``rope_freqs.weight`` tensor of one divisor per frequency:
llama.cpp's converter writes the divisors instead of the scaling parameters, so reading a GGUF recovers
parameters that reproduce them, and checks that they do.
"""
from __future__ import annotations

import numpy as np

from linnet.errors import UnsupportedModel
from linnet.rope import inv_frequencies
from linnet.spec import ModelSpec, RopeSpec


def llama3_factors(rope: RopeSpec, head_dim: int) -> np.ndarray:
    """The divisor of each rotary frequency (float32): plain over scaled frequencies, in float64 so that
    the divisors outside the band are exactly 1 and ``rope.factor``."""
    return (_plain(rope.theta, head_dim) / inv_frequencies(rope, head_dim, np.float64)).astype(np.float32)


def llama3_from_factors(theta: float, head_dim: int, factors: np.ndarray) -> RopeSpec:
    """Parameters that give ``factors``. Every Llama 3 uses low_freq_factor 1; with fewer than two
    frequencies in the smooth band, high_freq_factor 4 (also Llama 3's) is assumed too."""
    factors = np.asarray(factors, dtype=np.float64)
    if np.all(factors == 1.0):
        return RopeSpec(theta=theta)
    factor = float(factors.max())
    wavelen = 2 * np.pi / _plain(theta, head_dim)
    band = (factors > 1.0) & (factors < factor)
    # In the band, smooth = original / wavelen / (high - 1) - 1 / (high - 1): linear in 1 / wavelen.
    smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
    if band.sum() >= 2:
        slope, intercept = np.polyfit(1 / wavelen[band], smooth, 1)
        high = 1 - 1 / intercept
        original = slope * (high - 1)
    elif band.sum() == 1:
        high = 4.0
        original = float(wavelen[band][0] * (3 * smooth[0] + 1))
    else:
        raise UnsupportedModel("rope_freqs.weight has no frequency between its bounds; cannot recover Llama 3 scaling")
    rope = RopeSpec(theta=theta, kind="llama3", factor=factor, low_freq_factor=1.0,
                    high_freq_factor=float(round(high, 4)), original_max_positions=int(round(original)))
    if not np.allclose(llama3_factors(rope, head_dim), factors, rtol=1e-4):
        raise UnsupportedModel("rope_freqs.weight does not follow Llama 3 rope scaling")
    return rope


def _plain(theta: float, head_dim: int) -> np.ndarray:
    return inv_frequencies(RopeSpec(theta), head_dim, np.float64)


def rope_permute(spec: ModelSpec, canonical: str, array: np.ndarray, inverse: bool = False) -> np.ndarray:
    """llama.cpp's ``llama`` graph (and granite's, smollm3's: its "norm" rope) rotates interleaved pairs
    where HF rotates halves, so its converter reorders the rows of each q and k head (biases too);
    ``inverse`` undoes that. The other graphs (its "neox" rope) rotate halves, as HF does."""
    from linnet.arch import get_architecture

    part = canonical.rsplit(".", 1)[-1]
    if part not in ("q", "q_bias", "k", "k_bias") or not get_architecture(spec.architecture).gguf_interleaved_rope:
        return array
    heads = spec.num_heads if part.startswith("q") else spec.num_kv_heads
    split = (heads, spec.head_dim // 2, 2) if inverse else (heads, 2, spec.head_dim // 2)
    return array.reshape(*split, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
