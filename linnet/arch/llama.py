"""Llama: ``attention_bias`` puts a bias on q, k, v and o alike; no q/k norm."""
from linnet.arch import Architecture


def _flags(config) -> dict[str, bool]:
    bias = bool(config.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": False}


ARCHITECTURE = Architecture("LlamaForCausalLM", "llama", tied_by_default=False, attention_flags=_flags)
