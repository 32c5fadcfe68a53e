"""SmolLM3: Llama's layer, with rotary embedding left out of the layers ``no_rope_layers`` marks 0
(every fourth). llama.cpp's smollm3 graph leaves out exactly every fourth, and slides on no layer."""
from linnet.arch import Architecture
from linnet.arch.blocks import (
    LLAMA_NAMES,
    gguf_biases,
    hf_layer_types,
    no_window,
    pre_norm_layer,
    refuse,
    sliding_layers,
)
from linnet.errors import UnsupportedModel

NOPE_STEP = 4  # llama.cpp's n_no_rope_layer_step


def read_config(c) -> dict:
    refuse(c, "hidden_act", "silu", "SmolLM3's MLP is SwiGLU")
    layers = c.count("num_hidden_layers")
    flags = c.get("no_rope_layers", [1] * layers, list)
    if len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise UnsupportedModel(f"{c.where}: no_rope_layers must be a 0 or 1 per layer, got {flags!r}")
    bias = bool(c.get("attention_bias", False, bool))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(c.get("mlp_bias", False, bool)),
            "nope_layers": tuple(i for i, f in enumerate(flags) if f == 0), **sliding_layers(c)}


def hf_config(spec) -> dict:
    return {"hidden_act": "silu", "attention_bias": spec.qkv_bias, "mlp_bias": spec.mlp_bias,
            "no_rope_layers": [int(i not in spec.nope_layers) for i in range(spec.num_layers)],
            "use_sliding_window": "sliding" in spec.layer_types, **hf_layer_types(spec)}


def nope_layers(layers: int) -> tuple[int, ...]:
    return tuple(i for i in range(layers) if (i + 1) % NOPE_STEP == 0)


def gguf_config(keys) -> dict:
    layers = keys.number("block_count")
    return {**gguf_biases(keys), "nope_layers": nope_layers(layers), "layer_types": ("full",) * layers}


def gguf_metadata(spec) -> dict:
    no_window(spec, "llama.cpp's smollm3 graph")
    if spec.nope_layers != nope_layers(spec.num_layers):
        raise UnsupportedModel(f"llama.cpp's smollm3 graph leaves rotary out of every {NOPE_STEP}th layer "
                               f"{list(nope_layers(spec.num_layers))}, not this model's {list(spec.nope_layers)}")
    return {}


ARCHITECTURE = Architecture("SmolLM3ForCausalLM", "smollm3", "smollm3", read_config, pre_norm_layer, LLAMA_NAMES,
                            hf_config=hf_config, gguf_config=gguf_config, gguf_metadata=gguf_metadata,
                            gguf_interleaved_rope=True)
