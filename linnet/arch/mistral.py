"""Mistral: Llama's layer; ``sliding_window`` (Mistral 7B v0.1's 4096) makes every layer attend over
that many tokens. llama.cpp reads it as ``llama``, whose graph has no sliding window: a GGUF of a
windowed Mistral is refused, and one without a window reads back as Llama."""
from linnet.arch import Architecture
from linnet.arch.blocks import LLAMA_NAMES, hf_uniform_window, no_window, pre_norm_layer, refuse, sliding_layers


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "Mistral's MLP is SwiGLU")
    return sliding_layers(c)


def gguf_metadata(spec) -> dict:
    no_window(spec, "llama.cpp's llama graph (Mistral's GGUF form)")
    return {}


ARCHITECTURE = Architecture(
    "MistralForCausalLM", "llama", "mistral", read_config, pre_norm_layer, LLAMA_NAMES,
    hf_config=lambda spec: {"hidden_act": "silu", **hf_uniform_window(spec)},
    gguf_metadata=gguf_metadata, gguf_interleaved_rope=True,
)
