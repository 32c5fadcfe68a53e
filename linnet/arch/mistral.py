"""Mistral: Llama's layer; ``sliding_window`` (Mistral 7B v0.1's 4096) makes every layer attend over
that many tokens. llama.cpp reads it as ``llama``."""
from linnet.arch import Architecture
from linnet.arch.blocks import LLAMA_NAMES, pre_norm_layer, refuse, sliding_layers


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "Mistral's MLP is SwiGLU")
    return sliding_layers(c)


ARCHITECTURE = Architecture("MistralForCausalLM", "llama", "mistral", read_config, pre_norm_layer, LLAMA_NAMES)
