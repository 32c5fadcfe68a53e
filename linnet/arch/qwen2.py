"""Qwen2: q, k and v always carry a bias, o never does; no q/k norm."""
from linnet.arch import Architecture


def _flags(config) -> dict[str, bool]:
    return {"qkv_bias": True, "o_bias": False, "qk_norm": False}


ARCHITECTURE = Architecture("Qwen2ForCausalLM", "qwen2", tied_by_default=False, attention_flags=_flags)
