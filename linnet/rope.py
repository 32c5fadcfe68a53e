"""Rotary position embedding: the one definition every backend, and GGUF's rope tensors, derive from.

Frequencies and angles are rounded to float32 where transformers rounds them, operation for operation
(``a / x`` as ``(1 / x) * a``, which is how torch evaluates a number over a tensor; a tensor over a
number, or times one, takes the number as float32 first): an angle is position times frequency, so one
ulp of a frequency moves the angle at position 100k by up to 1e-2. The power is taken in double and
rounded once; NumPy's float32 power is several ulps off, torch's (SLEEF) within one, which is as close as
two torch builds agree.

The scaling kinds, as transformers 5 computes them (``transformers.modeling_rope_utils``):

- ``linear``: every frequency divided by ``factor``.
- ``llama3``: long wavelengths slowed by ``factor``, short ones kept, the band between blended.
- ``yarn``: each frequency blended between itself (extrapolation) and itself over ``factor``
  (interpolation) by a ramp over the dimensions between where ``beta_fast`` and ``beta_slow`` rotations fit
  in the original context; cos and sin multiplied by ``attention_factor``.
- ``longrope``: each frequency divided by its own factor, cos and sin multiplied by ``attention_factor``.
  transformers picks the short or the long factors for a whole forward pass from its length (long when
  its last position + 1 exceeds ``original_max_positions``). A table has one row per position, so here
  positions below ``original_max_positions`` take the short factors and those from it on the long ones.
  That is exactly transformers' token-by-token decoding (each step's keys are cached rotated by the
  factors of that step), and its prefill whenever the prompt fits in the original context; a prefill
  longer than the original context rotates all of its positions, the early ones too, by the long factors,
  which no per-position table reproduces.
- ``dynamic`` (NTK): transformers recomputes the base as ``theta * (factor * seq_len / original -
  (factor - 1)) ** (dim / (dim - 2))`` whenever the sequence outgrows ``original_max_positions`` (its
  ``max_position_embeddings``). Here position p takes the frequencies of seq_len = max(p + 1, original):
  plain below the original context, then one base per position. That is exactly transformers'
  token-by-token decoding past the original context (each step grows seq_len by one; keys are cached as
  rotated then), and any prefill that ends within it; a prefill that ends past it rotates all of its
  positions by the frequencies of its own length, which no per-position table reproduces (nor does
  transformers agree with itself there: decoding after it keeps the keys of that one length).
"""
from __future__ import annotations

import math

import numpy as np

from linnet.spec import ModelSpec, RopeSpec


def inv_frequencies(rope: RopeSpec, rotary_dim: int, dtype: type = np.float32, long: bool = False) -> np.ndarray:
    """The ``rotary_dim / 2`` rotary frequencies (radians per position), scaling applied: float32 as
    transformers computes them, or every step in ``dtype`` (float64 for GGUF's scaling factors). For
    ``longrope`` the short factors' (``long``: the long ones'); for ``dynamic`` those of the original
    context (``rope_tables`` gives the later positions theirs)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=dtype) / dtype(rotary_dim)
    powers = (rope.theta ** exponents.astype(np.float64)).astype(dtype)
    if rope.kind == "longrope":  # 1 / (factors * theta ** x), the factors as float32
        factors: np.ndarray = np.array(rope.long_factors if long else rope.short_factors, dtype=dtype)
        return 1 / (factors * powers)
    inv_freq = 1 / powers
    if rope.kind in ("default", "dynamic"):
        return inv_freq
    if rope.kind == "linear":  # positions divided by the factor, as transformers divides the frequencies
        return inv_freq / dtype(rope.factor)
    if rope.kind == "yarn":
        return _yarn(rope, rotary_dim, powers, inv_freq, dtype)
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


def _yarn(rope: RopeSpec, dim: int, powers: np.ndarray, extrapolation: np.ndarray, dtype: type) -> np.ndarray:
    """transformers' _compute_yarn_parameters: the correction range in double, the ramp and blend in ``dtype``."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    interpolation = 1 / (dtype(rope.factor) * powers)
    ramp = np.clip((np.arange(dim // 2, dtype=dtype) - dtype(low)) / dtype(high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def _dynamic_frequencies(rope: RopeSpec, dim: int, seq_lens: np.ndarray) -> np.ndarray:
    """``[len(seq_lens), dim / 2]``: dynamic NTK's frequencies for each sequence length past the original,
    the base computed in float32 as torch does from a tensor seq_len."""
    f32 = np.float32
    ratio = (f32(rope.factor) * seq_lens.astype(f32)) / f32(rope.original_max_positions) - f32(rope.factor - 1)
    base = f32(rope.theta) * (ratio.astype(np.float64) ** float(f32(dim / (dim - 2)))).astype(f32)
    exponents = (np.arange(0, dim, 2, dtype=f32) / f32(dim)).astype(np.float64)
    return 1 / (base.astype(np.float64)[:, None] ** exponents).astype(f32)


def rope_tables(spec: ModelSpec, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every angle, each float32 ``[positions, rotary_dim * spec.rope_table_count]``; the
    angles of a position are listed twice (``cat(angles, angles)``), since HF rotates the two halves of a
    head by the same angle. A spec with a ``local_rope`` has two tables side by side: the global rope's
    (columns ``[0, rotary_dim)``), then the local rope's (``[rotary_dim, 2 * rotary_dim)``), as the
    Program's ``rotary(...; table=j)`` reads them. Row p depends on p alone, never on ``positions``."""
    cos, sin = _table(spec.rope, spec.rotary_dim, positions)
    if spec.local_rope is None:
        return cos, sin
    local_cos, local_sin = _table(spec.local_rope, spec.rotary_dim, positions)
    return np.concatenate([cos, local_cos], axis=-1), np.concatenate([sin, local_sin], axis=-1)


def _table(rope: RopeSpec, dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """One rope's cos and sin, each float32 ``[positions, dim]``."""
    freqs = np.broadcast_to(inv_frequencies(rope, dim), (positions, dim // 2))
    original = rope.original_max_positions
    if rope.kind in ("longrope", "dynamic") and positions > original:  # per position from original on
        freqs = freqs.copy()
        if rope.kind == "longrope":
            freqs[original:] = inv_frequencies(rope, dim, long=True)
        else:
            freqs[original:] = _dynamic_frequencies(rope, dim, np.arange(original, positions) + 1)
    angles = np.arange(positions, dtype=np.float32)[:, None] * freqs
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(angles), np.sin(angles)
    if rope.attention_factor != 1.0:  # transformers multiplies float32 cos and sin by it as float32
        cos, sin = cos * np.float32(rope.attention_factor), sin * np.float32(rope.attention_factor)
    return cos, sin
