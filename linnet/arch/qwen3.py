"""Qwen3: per-head RMS norm of q and k before rotary; ``attention_bias`` covers q, k, v and o."""
from linnet.arch import Architecture


def _flags(config) -> dict[str, bool]:
    bias = bool(config.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


ARCHITECTURE = Architecture("Qwen3ForCausalLM", "qwen3", tied_by_default=False, attention_flags=_flags)
