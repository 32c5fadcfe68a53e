"""The pieces architectures build their layers from (as llama.cpp's ``build_attn`` and ``build_ffn``),
the Llama family's weight names, and the config readings and checkpoint forms several families share."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from linnet.errors import UnsupportedModel

if TYPE_CHECKING:
    from linnet.gguf.reader import GGUFKeys
    from linnet.program.builder import SectionBuilder
    from linnet.spec import ConfigReader, ModelSpec


# canonical part -> (Hugging Face name, GGUF name); "{i}" is the layer index.
LLAMA_NAMES: dict[str, tuple[str | None, str | None]] = {
    "embed": ("model.embed_tokens.weight", "token_embd.weight"),
    "norm": ("model.norm.weight", "output_norm.weight"),
    "lm_head": ("lm_head.weight", "output.weight"),
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", "blk.{i}.attn_norm.weight"),
    "q": ("model.layers.{i}.self_attn.q_proj.weight", "blk.{i}.attn_q.weight"),
    "q_bias": ("model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias"),
    "k": ("model.layers.{i}.self_attn.k_proj.weight", "blk.{i}.attn_k.weight"),
    "k_bias": ("model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias"),
    "v": ("model.layers.{i}.self_attn.v_proj.weight", "blk.{i}.attn_v.weight"),
    "v_bias": ("model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias"),
    "o": ("model.layers.{i}.self_attn.o_proj.weight", "blk.{i}.attn_output.weight"),
    "o_bias": ("model.layers.{i}.self_attn.o_proj.bias", "blk.{i}.attn_output.bias"),
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", "blk.{i}.attn_q_norm.weight"),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", "blk.{i}.attn_k_norm.weight"),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", "blk.{i}.ffn_norm.weight"),
    "gate": ("model.layers.{i}.mlp.gate_proj.weight", "blk.{i}.ffn_gate.weight"),
    "gate_bias": ("model.layers.{i}.mlp.gate_proj.bias", "blk.{i}.ffn_gate.bias"),
    "up": ("model.layers.{i}.mlp.up_proj.weight", "blk.{i}.ffn_up.weight"),
    "up_bias": ("model.layers.{i}.mlp.up_proj.bias", "blk.{i}.ffn_up.bias"),
    "down": ("model.layers.{i}.mlp.down_proj.weight", "blk.{i}.ffn_down.weight"),
    "down_bias": ("model.layers.{i}.mlp.down_proj.bias", "blk.{i}.ffn_down.bias"),
}


# -- the Program's pieces ---------------------------------------------------------------------------------

def embed(b: SectionBuilder) -> str:
    return b.scale(b.embedding(), b.spec.embedding_multiplier, "x_scaled")


def head(b: SectionBuilder) -> str:
    """The last norm, the output projection (a tied one reads the embedding), multiplier and softcap."""
    spec = b.spec
    h = b.norm(b.select("x"), "norm")
    logits = b.linear(h, "lm_head", spec.vocab_size, hint="logits_act")
    logits = b.softcap(b.scale(logits, spec.logit_multiplier, "logits_scaled"), spec.final_softcap, "logits_capped")
    return b.cast(logits, "f32", "logits")


def layer_kinds(spec: ModelSpec) -> tuple[str, ...]:
    """Each layer's kind: "full" or "sliding", with "-nope" for a layer without rotary embedding."""
    return tuple(spec.layer_type(i) + ("-nope" if i in spec.nope_layers else "") for i in range(spec.num_layers))


def attention(b: SectionBuilder, h: str, kind: str, qk_norm: str | None = None) -> str:
    """Self-attention of h over the cache: q/k/v projections, q/k norms (``"head"``: per head, as Qwen3;
    ``"flat"``: over the whole projection, as OLMo 2), rotary (unless the kind is "-nope"; by the local
    rope's table on "sliding" kinds of a spec that has one), the cache writes, attention (a window on
    "sliding" kinds) and the output projection."""
    spec = b.spec
    q = b.linear(h, "q", spec.q_size, spec.qkv_bias)
    k = b.linear(h, "k", spec.kv_size, spec.qkv_bias)
    v = b.linear(h, "v", spec.kv_size, spec.qkv_bias)
    if qk_norm == "flat":
        q, k = b.rms_norm(q, "q_norm", "q_normed"), b.rms_norm(k, "k_norm", "k_normed")
    q = b.split_heads(q, spec.num_heads, "q_heads")
    k = b.split_heads(k, spec.num_kv_heads, "k_heads")
    v = b.split_heads(v, spec.num_kv_heads, "v_heads")
    if qk_norm == "head":
        q, k = b.rms_norm(q, "q_norm", "q_normed"), b.rms_norm(k, "k_norm", "k_normed")
    if not kind.endswith("-nope"):
        table = 1 if kind.startswith("sliding") and spec.local_rope is not None else 0  # the local rope's
        q, k = b.rotary(q, "q_rot", table), b.rotary(k, "k_rot", table)
    cache_k = b.cache_write("cache_k", k, "cache_k_out")
    cache_v = b.cache_write("cache_v", v, "cache_v_out")
    window = spec.sliding_window if kind.startswith("sliding") else None
    attn = b.attention(q, cache_k, cache_v, spec.scale, spec.attn_softcap, window,
                       "sinks" if spec.attention_sinks else None)
    return b.linear(attn, "o", spec.hidden_size, spec.o_bias, hint="attn_out")


def mlp(b: SectionBuilder, h: str, prefix: str = "", size: int | None = None) -> str:
    """The gated MLP: act(gate(h)) * up(h), then down; SwiGLU for SiLU. ``prefix`` and ``size``: another
    MLP's weights and width (a shared expert's)."""
    spec = b.spec
    size = size or spec.intermediate_size
    gate = b.linear(h, f"{prefix}gate", size, spec.mlp_bias)
    up = b.linear(h, f"{prefix}up", size, spec.mlp_bias)
    if spec.activation == "silu":
        act = b.op("swiglu", (gate, up), f"{prefix}act")
    else:
        act = b.mul(b.activation(gate, spec.activation, f"{prefix}gate_act"), up, f"{prefix}act")
    return b.linear(act, f"{prefix}down", spec.hidden_size, spec.mlp_bias, hint=f"{prefix}mlp_out")


def residual(b: SectionBuilder, x: str, out: str, hint: str) -> str:
    """x + out, the sublayer's output scaled by the residual multiplier."""
    return b.add(x, b.scale(out, b.spec.residual_multiplier, f"{out}_scaled"), hint)


def pre_norm_layer(b: SectionBuilder, kind: str, qk_norm: str | None = None,
                   ffn: Callable[[SectionBuilder, str], str] = mlp) -> str:
    """Llama's layer: x + attn(norm(x)), then + mlp(norm(x)); or, with a parallel residual,
    x + attn(norm1(x)) + mlp(norm2(x)). ``ffn``: the MLP's builder (a mixture of experts')."""
    h = b.norm("x", "attn_norm")
    attn = attention(b, h, kind, qk_norm)
    if b.spec.parallel_residual:
        out = ffn(b, b.norm("x", "mlp_norm", "h_mlp"))
        return residual(b, residual(b, "x", attn, "x_attn"), out, "x_out")
    x = residual(b, "x", attn, "x_attn")
    return residual(b, x, ffn(b, b.norm(x, "mlp_norm", "h_mlp")), "x_out")


# -- config readings --------------------------------------------------------------------------------------

def refuse(reader: ConfigReader, key: str, allowed: Any, what: str) -> None:
    """An error naming ``key`` unless it is absent or ``allowed``."""
    value = reader.config.get(key)
    if value is not None and value != allowed:
        raise UnsupportedModel(f"{reader.where}: {key}={value!r} is not supported ({what})")


def activation(reader: ConfigReader, key: str = "hidden_act", default: str = "silu") -> str:
    names = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
    value = reader.get(key, default, str)
    if value not in names:
        raise UnsupportedModel(f"{reader.where}: {key}={value!r} is not supported (supported: {', '.join(names)})")
    return names[value]


def sliding_layers(reader: ConfigReader, default_pattern: int | None = None) -> dict[str, Any]:
    """``layer_types`` (transformers 5) with ``sliding_window``: the spec's layer types and window.
    Without layer_types, ``default_pattern`` n makes every n-th layer full and the others sliding
    (Gemma 2's 2, Gemma 3's 6); without that, ``use_sliding_window`` decides for all layers."""
    layers = reader.count("num_hidden_layers")
    types = reader.get("layer_types", None, list)
    window = reader.get("sliding_window", None, int)
    if types is None:
        if default_pattern is not None:
            types = ["full_attention" if (i + 1) % default_pattern == 0 else "sliding_attention" for i in range(layers)]
        elif window is not None and reader.get("use_sliding_window", True, bool):
            types = ["sliding_attention"] * layers
        else:
            types = ["full_attention"] * layers
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    unknown = sorted({str(t) for t in types} - set(names))
    if unknown:
        raise UnsupportedModel(f"{reader.where}: layer_types {unknown} are not supported "
                               "(full_attention, sliding_attention)")
    layer_types = tuple(names[t] for t in types)
    if "sliding" not in layer_types:
        return {"layer_types": layer_types, "sliding_window": None}
    if window is None:
        raise UnsupportedModel(f"{reader.where} has sliding layers but no sliding_window")
    if window < 1:
        raise reader.fail("sliding_window", f"expected a positive integer, got {window!r}")
    return {"layer_types": layer_types, "sliding_window": window}


def partial_rotary(reader: ConfigReader, head_dim: int, default: float = 1.0,
                   key: str = "partial_rotary_factor") -> int | None:
    """The rotary dims from a factor of the head (transformers rounds down to an int)."""
    params = reader.get("rope_parameters", {}, dict)
    factor = params.get(key, reader.config.get(key, default))
    if factor == 1.0:
        return None
    factor = reader.number(key, factor)
    return int(head_dim * factor)


def optional_number(reader: ConfigReader, key: str) -> float | None:
    value = reader.config.get(key)
    return None if value is None else reader.number(key)


# -- checkpoint forms: what several families' GGUF metadata and config.json keys share ---------------------

def gguf_biases(keys: GGUFKeys) -> dict[str, bool]:
    """Optional biases, as llama.cpp finds them: by the tensors present (layer 0 stands for all)."""
    return {"qkv_bias": keys.has("blk.0.attn_q.bias"), "o_bias": keys.has("blk.0.attn_output.bias"),
            "mlp_bias": keys.has("blk.0.ffn_down.bias")}


def needs_head(keys: GGUFKeys, tied: bool) -> None:
    """A graph that reads only one of ``output.weight`` (untied) and ``token_embd.weight`` (tied) as its head."""
    if keys.has("output.weight") == tied:
        raise UnsupportedModel(f"{keys.where}: llama.cpp's {keys.family} graph needs "
                               f"{'a tied head (no output.weight)' if tied else 'an untied head (output.weight)'}")


def plain_heads(spec: ModelSpec, form: str) -> None:
    """Forms that derive head_dim from hidden_size / num_attention_heads."""
    if spec.head_dim * spec.num_heads != spec.hidden_size:
        raise UnsupportedModel(f"{form} cannot express head_dim {spec.head_dim} (it is hidden_size "
                               f"{spec.hidden_size} / num_attention_heads {spec.num_heads})")


def no_window(spec: ModelSpec, form: str) -> None:
    """Forms without sliding-window attention; a window of max_positions or more never hides a token."""
    window = spec.sliding_window
    if "sliding" in spec.layer_types and window is not None and window < spec.max_positions:
        raise UnsupportedModel(f"{form} has no sliding-window attention; {spec.architecture}'s "
                               f"sliding_window={spec.sliding_window} cannot be written")


HF_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def hf_uniform_window(spec: ModelSpec) -> dict[str, Any]:
    """config.json's sliding_window for families that slide on every layer or none (no layer_types)."""
    return {"sliding_window": spec.sliding_window if "sliding" in spec.layer_types else None}


def hf_layer_types(spec: ModelSpec) -> dict[str, Any]:
    names = {"full": "full_attention", "sliding": "sliding_attention"}
    types = [names[spec.layer_type(i)] for i in range(spec.num_layers)]
    return {"layer_types": types, "sliding_window": spec.sliding_window}


def hf_partial_rotary(spec: ModelSpec) -> dict[str, Any]:
    """partial_rotary_factor (1.0 for all of the head), one that transformers' int() turns back into rope_dim."""
    if spec.rope_dim is None:
        return {"partial_rotary_factor": 1.0}
    return {"partial_rotary_factor": shortest(spec.rope_dim / spec.head_dim,
                                              lambda f: int(spec.head_dim * f) == spec.rope_dim)}


def shortest(value: float, reads_back: Callable[[float], bool]) -> float | int:
    """The shortest decimal near ``value`` that a config reader turns back into the same spec value
    (query_pre_attn_scalar 24, not 23.999999999999996); ``value`` itself when none does."""
    for digits in range(17):
        candidate = round(value, digits)
        if reads_back(candidate):
            return int(candidate) if candidate.is_integer() else candidate
    return value


def check_reads_back(spec: ModelSpec, back: ModelSpec, form: str, float32: bool = False) -> None:
    """``back``, what ``form`` reads as, is the model ``spec`` describes (``float32``: floats as float32),
    or an error naming each field that differs. Windows that hide nothing (max_positions or wider) count as
    full attention, and no attention scale as head_dim ** -0.5."""
    differing = _differences(_canonical(spec), _canonical(back), float32)
    if differing:
        raise UnsupportedModel(f"{form} cannot express {spec.architecture}'s " + ", ".join(
            f"{name}={ours!r} (it would read back as {theirs!r})" for name, ours, theirs in differing))


def _differences(ours: Any, theirs: Any, float32: bool, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(field, ours, theirs) of each field that differs; a nested spec's by its own fields ("moe.top_k")."""
    out = []
    for f in fields(ours):
        a, b = getattr(ours, f.name), getattr(theirs, f.name)
        if is_dataclass(a) and type(a) is type(b):
            out += _differences(a, b, float32, f"{prefix}{f.name}.")
        elif not _same(a, b, float32):
            out.append((prefix + f.name, a, b))
    return out


def _canonical(spec: ModelSpec) -> ModelSpec:
    window = spec.sliding_window is not None and spec.sliding_window < spec.max_positions
    types = tuple(t if window else "full" for t in spec.layer_types)
    spec = replace(spec, attention_scale=spec.scale)
    if "sliding" in types:
        return replace(spec, layer_types=types)
    return replace(spec, layer_types=(), sliding_window=None)


def _same(a: Any, b: Any, float32: bool) -> bool:
    if float32 and isinstance(a, float) and isinstance(b, (int, float)):
        return bool(np.float32(a) == np.float32(b))
    return a == b
