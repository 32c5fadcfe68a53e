"""Rotary position embedding: the one definition every backend, and GGUF's Llama 3 factors, derive from.

Frequencies and angles are rounded to float32 where transformers rounds them, operation for operation
(``a / x`` as ``(1 / x) * a``, which is how torch evaluates a number over a tensor): an angle is position
times frequency, so one ulp of a frequency moves the angle at position 100k by up to 1e-2. The power is
taken in double and rounded once; NumPy's float32 power is several ulps off, torch's (SLEEF) within one,
which is as close as two torch builds agree.
"""
from __future__ import annotations

import math

import numpy as np

from linnet.spec import ModelSpec, RopeSpec


def inv_frequencies(rope: RopeSpec, head_dim: int, dtype: type = np.float32) -> np.ndarray:
    """The ``head_dim / 2`` rotary frequencies (radians per position), Llama 3 scaling applied: float32
    as transformers computes them, or every step in ``dtype`` (float64 for GGUF's scaling factors)."""
    exponents = np.arange(0, head_dim, 2, dtype=dtype) / dtype(head_dim)
    inv_freq = 1 / (rope.theta ** exponents.astype(np.float64)).astype(dtype)
    if rope.kind == "default":
        return inv_freq
    if rope.kind == "linear":  # positions divided by the factor, as transformers divides the frequencies
        return inv_freq / dtype(rope.factor)
    if rope.kind != "llama3":
        raise ValueError(f"rope kind {rope.kind!r} has no frequencies defined")
    # Llama 3: wavelengths past original / low slowed by factor, those under original / high kept,
    # the band between blended (transformers' _compute_llama3_parameters).
    original, factor, low, high = rope.original_max_positions, rope.factor, rope.low_freq_factor, rope.high_freq_factor
    wavelen = (1 / inv_freq) * (2 * math.pi)
    scaled = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = ((1 / wavelen) * original - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(in_band, blended, scaled)


def rope_tables(spec: ModelSpec, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every angle, each float32 ``[positions, rotary_dim]``; the angles of a position are
    listed twice (``cat(angles, angles)``), since HF rotates the two halves of a head by the same angle."""
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv_frequencies(spec.rope, spec.rotary_dim)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles), np.sin(angles)
