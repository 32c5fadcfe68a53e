"""ModelSpec: one typed, frozen description of a decoder-only model, every dimension explicit.

A spec is read from a Hugging Face ``config.json`` (transformers 4 and 5 spellings) or from GGUF
metadata. Llama, Qwen2 and Qwen3 differ only in the data held here, never in code paths.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from linnet.dtypes import BY_HF, DTYPES
from linnet.errors import UnsupportedModel
from linnet.files import naming, read_json

MAX_LAYERS = 1024  # no published decoder has a quarter as many; bounds what a checkpoint makes Linnet allocate
MAX_EXPERTS = 4096  # the most published is 384 (Kimi K2); bounds the per-expert tensor names Linnet looks for


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding: plain (``default``), positions slowed by ``factor`` (``linear``), Llama 3
    frequency scaling (``llama3``), YaRN (``yarn``), LongRoPE (``longrope``) or dynamic NTK (``dynamic``);
    ``linnet.rope`` says what each computes. Values transformers uses as float32 (LongRoPE's factors,
    the attention factor) are kept as the shortest decimal of their float32."""

    theta: float
    kind: str = "default"  # "default" | "linear" | "llama3" | "yarn" | "longrope" | "dynamic"
    factor: float = 1.0  # linear, llama3, yarn, dynamic
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 1.0
    # llama3, yarn, longrope: the pretraining context; dynamic: max_position_embeddings, where it starts
    original_max_positions: int = 0
    attention_factor: float = 1.0  # yarn, longrope: cos and sin are multiplied by it
    beta_fast: float = 32.0  # yarn: the ramp runs between the dims that turn beta_fast and beta_slow
    beta_slow: float = 1.0  # times in the original context
    truncate: bool = True  # yarn: that range rounded out to whole dims
    short_factors: tuple[float, ...] = ()  # longrope: a divisor per frequency, positions below original
    long_factors: tuple[float, ...] = ()  # longrope: from original on

    def check(self, rotary_dim: int) -> None:
        """What the kind needs of the rotary dims (ModelSpec calls this; the reader cannot know them)."""
        if self.kind == "longrope":
            for name, values in (("short_factor", self.short_factors), ("long_factor", self.long_factors)):
                if len(values) != rotary_dim // 2:
                    raise UnsupportedModel(f"longrope {name} has {len(values)} entries; the {rotary_dim} rotary "
                                           f"dims need {rotary_dim // 2}")
        if self.kind == "dynamic" and rotary_dim < 4:
            raise UnsupportedModel(f"dynamic rope scaling needs 4 or more rotary dims, not {rotary_dim}")


GATINGS = ("softmax_topk", "topk_softmax")
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")


@dataclass(frozen=True)
class MoeSpec:
    """A mixture of experts in place of the dense MLP (the ``moe`` op of ``linnet.program``): a router picks
    ``top_k`` of ``experts`` gated MLPs of width ``size`` per token and weighs their outputs."""

    experts: int
    top_k: int
    size: int  # each expert's intermediate width
    # "softmax_topk": softmax over every expert, then the top k (Mixtral, Qwen-MoE, OLMoE); "topk_softmax":
    # the top k logits, then a softmax over those (gpt-oss, Granite-MoE)
    gating: str = "softmax_topk"
    normalize: bool = False  # softmax_topk: the top k's weights divided by their sum (Qwen's norm_topk_prob)
    router_bias: bool = False
    expert_bias: bool = False  # biases on each expert's gate, up and down (gpt-oss)
    activation: str = "swiglu"  # or "clamped_swiglu" (gpt-oss), with its alpha and limit
    alpha: float | None = None
    limit: float | None = None
    shared_size: int = 0  # a shared expert of this width beside the routed ones, sigmoid-gated (Qwen2-MoE)
    dense_layers: tuple[int, ...] = ()  # layers with the dense MLP (intermediate_size) instead

    def __post_init__(self) -> None:
        for name in ("experts", "top_k", "size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise UnsupportedModel(f"mixture of experts: {name} must be a positive integer, got {value!r}")
        if self.experts > MAX_EXPERTS:
            raise UnsupportedModel(f"{self.experts} experts is past Linnet's bound of {MAX_EXPERTS}")
        if self.top_k > self.experts:
            raise UnsupportedModel(f"mixture of experts: top_k {self.top_k} exceeds the {self.experts} experts")
        if self.normalize and self.gating != "softmax_topk":
            raise UnsupportedModel("mixture of experts: normalize applies to softmax_topk gating only")
        if self.gating not in GATINGS:
            raise UnsupportedModel(f"expert gating {self.gating!r} is not supported ({', '.join(GATINGS)})")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise UnsupportedModel(f"expert activation {self.activation!r} is not supported "
                                   f"({', '.join(EXPERT_ACTIVATIONS)})")
        clamped = self.activation == "clamped_swiglu"
        for name in ("alpha", "limit"):
            value = getattr(self, name)
            if clamped != (value is not None) or clamped and (type(value) not in (int, float) or
                                                              not math.isfinite(value) or value <= 0):
                raise UnsupportedModel(f"mixture of experts: {name} {value!r} must be a finite, positive number "
                                       "for clamped_swiglu, and absent otherwise")
        if type(self.shared_size) is not int or self.shared_size < 0:
            raise UnsupportedModel(f"shared expert size must be a whole number, got {self.shared_size!r}")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for ``factor`` (transformers' yarn_get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def f32_decimal(value: float) -> float:
    """The shortest decimal that is the same float32: what a float32 computation sees of ``value``."""
    return float(str(np.float32(value)))


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # the HF ``architectures`` name, e.g. "Qwen2ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    dtype: str = "f32"  # the checkpoint's dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # What the families beyond Llama differ in, each read by its architecture; the defaults are Llama's.
    norm: str = "rms"  # "rms" | "layer" (LayerNorm with a bias); rms_norm_eps is either's epsilon
    activation: str = "silu"  # the MLP's: "silu" | "gelu" | "gelu_tanh"
    mlp_bias: bool = False
    rope_dim: int | None = None  # partial rotary: the leading dims of a head that rotate; None: all
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0  # on each sublayer's output before its residual add
    logit_multiplier: float = 1.0
    sliding_window: int | None = None  # the window of "sliding" layers, in tokens (the query's own included)
    layer_types: tuple[str, ...] = ()  # per layer "full" | "sliding"; empty: every layer full
    nope_layers: tuple[int, ...] = ()  # layers without rotary embedding
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x))
    # The sliding layers' own rotary embedding (Gemma 3's local base); None: every layer rotates by ``rope``
    local_rope: RopeSpec | None = None
    moe: MoeSpec | None = None  # a mixture of experts in place of the MLP; None: dense
    attention_sinks: bool = False  # a learned logit per head in attention's softmax (gpt-oss)

    def __post_init__(self) -> None:
        """What every reader's values must satisfy, whatever the file said: the last line of defence
        against a checkpoint that would make Linnet divide by zero or allocate without bound."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_positions"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise UnsupportedModel(f"{name} must be a positive integer, got {value!r}")
        if self.num_layers > MAX_LAYERS:
            raise UnsupportedModel(f"{self.num_layers} layers is past Linnet's bound of {MAX_LAYERS}")
        if self.head_dim % 2:
            raise UnsupportedModel(f"head_dim {self.head_dim} is odd; rotary embeddings rotate pairs")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        thetas = [("rope theta", self.rope.theta)] + ([("local rope theta", self.local_rope.theta)]
                                                      if self.local_rope is not None else [])
        for name, value in (("rms_norm_eps", self.rms_norm_eps), *thetas):
            if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
                raise UnsupportedModel(f"{name} must be a finite, positive number, got {value!r}")
        if self.dtype not in DTYPES:
            raise UnsupportedModel(f"unsupported dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        self._check_family_fields()
        self.rope.check(self.rotary_dim)
        if self.local_rope is not None:
            self.local_rope.check(self.rotary_dim)
        ids = [self.bos_token_id, *self.eos_token_ids]
        if any(i is not None and (type(i) is not int or not 0 <= i < self.vocab_size) for i in ids):
            raise UnsupportedModel(f"token ids {ids} (bos, eos) must be in the vocabulary of {self.vocab_size}")

    def _check_family_fields(self) -> None:
        if self.norm not in ("rms", "layer"):
            raise UnsupportedModel(f"norm {self.norm!r} is not supported (rms, layer)")
        if self.activation not in ("silu", "gelu", "gelu_tanh"):
            raise UnsupportedModel(f"activation {self.activation!r} is not supported (silu, gelu, gelu_tanh)")
        if self.rope_dim is not None and (type(self.rope_dim) is not int or self.rope_dim % 2 or
                                          not 0 < self.rope_dim <= self.head_dim):
            raise UnsupportedModel(f"rotary dimension {self.rope_dim!r} must be even and within "
                                   f"head_dim {self.head_dim}")
        for name in ("attention_scale", "attn_softcap", "final_softcap", "embedding_multiplier",
                     "residual_multiplier", "logit_multiplier"):
            value = getattr(self, name)
            if value is not None and (type(value) not in (int, float) or not math.isfinite(value) or value <= 0):
                raise UnsupportedModel(f"{name} must be a finite, positive number, got {value!r}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - {"full", "sliding"}:
                raise UnsupportedModel(f"layer_types must give 'full' or 'sliding' for each of the {self.num_layers} "
                                       f"layers, got {list(self.layer_types)}")
            if "sliding" in self.layer_types and not (type(self.sliding_window) is int and self.sliding_window > 0):
                raise UnsupportedModel(f"sliding layers need a positive sliding_window, got {self.sliding_window!r}")
        if any(type(i) is not int or not 0 <= i < self.num_layers for i in self.nope_layers):
            raise UnsupportedModel(f"layers without rotary {list(self.nope_layers)} must be layer indices")
        if self.moe is not None and any(type(i) is not int or not 0 <= i < self.num_layers
                                        for i in self.moe.dense_layers):
            raise UnsupportedModel(f"dense layers {list(self.moe.dense_layers)} must be layer indices")

    @property
    def rotary_dim(self) -> int:
        return self.head_dim if self.rope_dim is None else self.rope_dim

    @property
    def rope_table_count(self) -> int:
        """The rotary tables of a step (``linnet.rope.rope_tables``): the global one, and the local one."""
        return 1 if self.local_rope is None else 2

    @property
    def scale(self) -> float:
        """Attention's scale of q . k."""
        return self.head_dim ** -0.5 if self.attention_scale is None else float(self.attention_scale)

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full"

    @property
    def family(self) -> str:
        from linnet.arch import get_architecture

        return get_architecture(self.architecture).family

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def parameter_count(self) -> int:
        """Every tensor's elements, as the architecture's Program reads them (a tied head counted once)."""
        from linnet.program import build_program

        return sum(math.prod(shape) for shape in build_program(self).expected_shapes().values())

    def active_parameter_count(self) -> int:
        """The parameters one token's step reads: every tensor, each layer's routed experts counted
        top_k of experts (a prompt's tokens, together, may read more)."""
        from linnet.program import build_program

        return round(sum(math.prod(shape) * self.token_share(name)
                         for name, shape in build_program(self).expected_shapes().items()))

    def token_share(self, canonical: str) -> float:
        """The share of a canonical tensor one token's step reads: top_k of experts of a routed expert's
        (its matrices and biases), all of any other (a router, a shared expert, the dense parts)."""
        if self.moe is None or not canonical.rsplit(".", 1)[-1].startswith("expert_"):
            return 1.0
        return self.moe.top_k / self.moe.experts

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("eos_token_ids", "layer_types", "nope_layers"):
            d[name] = list(d[name])
        if d["moe"] is not None:
            d["moe"]["dense_layers"] = list(d["moe"]["dense_layers"])
        return d


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Read ``config.json`` in a Hugging Face model directory."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UnsupportedModel(f"no config.json in {model_dir}")
    with naming(path):
        return spec_from_hf_config(read_json(path, UnsupportedModel), str(path))


def spec_from_hf_config(config: Any, where: str = "config.json") -> ModelSpec:
    """The spec a config describes; every value is checked for its type and range, and a mistake is an
    UnsupportedModel naming ``where`` and the key."""
    from linnet.arch import get_architecture

    if not isinstance(config, dict):
        raise UnsupportedModel(f"{where}: expected a JSON object, got {type(config).__name__}")
    reader = ConfigReader(config, where)
    names = reader.get("architectures", [], list)
    if len(names) != 1 or not isinstance(names[0], str):
        raise UnsupportedModel(f"{where} must name exactly one architecture, found {names!r}")
    arch = get_architecture(names[0])
    hidden = reader.count("hidden_size")
    heads = reader.count("num_attention_heads")
    head_dim = reader.count("head_dim", hidden // heads)
    eos = reader.get("eos_token_id", [], (int, list))
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    dtype = reader.get("dtype", None, str) or reader.get("torch_dtype", "float32", str)
    if dtype not in BY_HF:
        raise UnsupportedModel(f"checkpoint dtype {dtype!r} is not supported")
    layers = reader.count("num_hidden_layers")
    if layers > MAX_LAYERS:  # before a family reader sizes per-layer lists by it
        raise reader.fail("num_hidden_layers", f"{layers} layers is past Linnet's bound of {MAX_LAYERS}")
    fields = dict(
        architecture=arch.name,
        vocab_size=reader.count("vocab_size"),
        hidden_size=hidden,
        intermediate_size=reader.count("intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=reader.count("num_key_value_heads", heads),
        head_dim=head_dim,
        rms_norm_eps=reader.number(arch.eps_key),
        max_positions=reader.count("max_position_embeddings"),
        tie_word_embeddings=bool(reader.get("tie_word_embeddings", arch.tied_by_default)),
        dtype=BY_HF[dtype].name,
        bos_token_id=reader.get("bos_token_id", None, int),
        eos_token_ids=eos_ids,
    )
    family = arch.read_config(reader)  # the family's fields; "rope" where it reads rope its own way (Gemma 3)
    if "rope" not in family:
        family["rope"] = rope_from_config(reader)
    return ModelSpec(**{**fields, **family})


class ConfigReader:
    """Reads config keys, each checked for its type; ``require`` names a missing key instead of guessing."""

    def __init__(self, config: dict[str, Any], where: str):
        self.config = config
        self.where = where

    def fail(self, key: str, message: str) -> UnsupportedModel:
        return UnsupportedModel(f"{self.where}: {key}: {message}")

    def get(self, key: str, default: Any, kind: type | tuple[type, ...] | None = None) -> Any:
        value = self.config.get(key)
        if value is None:
            return default
        if kind is not None and (not isinstance(value, kind) or isinstance(value, bool) and bool not in
                                 (kind if isinstance(kind, tuple) else (kind,))):
            raise self.fail(key, f"expected {_kind_name(kind)}, got {value!r}")
        return value

    def require(self, key: str) -> Any:
        if self.config.get(key) is None:
            raise UnsupportedModel(f"{self.where} lacks required key {key!r}")
        return self.config[key]

    def count(self, key: str, default: int | None = None) -> int:
        """A positive integer; required unless there is a default."""
        value = self.require(key) if default is None else self.get(key, default)
        if type(value) is not int or value < 1:
            raise self.fail(key, f"expected a positive integer, got {value!r}")
        return value

    def number(self, key: str, value: Any = None) -> float:
        """A finite, positive number (``value`` when given: a key inside a nested table)."""
        value = self.require(key) if value is None else value
        if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
            raise self.fail(key, f"expected a finite, positive number, got {value!r}")
        return float(value)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", list: "a list", str: "a string", dict: "an object", bool: "true or false"}
    return " or ".join(names[k] for k in (kind if isinstance(kind, tuple) else (kind,)))


PHI3_ORIGINAL_DEFAULT = 4096  # Phi3Config's original_max_position_embeddings when config.json omits it


def rope_from_config(reader: ConfigReader) -> RopeSpec:
    """The rope scaling transformers 5 reads from either spelling: transformers 4's rope_theta + rope_scaling
    or 5's rope_parameters (theta inside); errors name the section and key."""
    section = "rope_parameters" if reader.get("rope_parameters", None, dict) else "rope_scaling"
    params = ConfigReader({**reader.get("rope_scaling", {}, dict), **reader.get("rope_parameters", {}, dict)},
                          f"{reader.where}: {section}")
    theta = params.config.get("rope_theta", reader.config.get("rope_theta"))
    if theta is None:
        raise UnsupportedModel(f"{reader.where} lacks rope_theta (or rope_parameters.rope_theta)")
    theta = reader.number("rope_theta", theta)
    kind = params.get("rope_type", None, str) or params.get("type", "default", str)
    phi3 = reader.config.get("architectures") == ["Phi3ForCausalLM"]
    if phi3 and kind in ("su", "yarn"):  # Phi3Config reads both as LongRoPE
        kind = "longrope"
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=params.number("factor"))
    max_positions = reader.count("max_position_embeddings")
    if kind == "dynamic":  # transformers grows the base past max_position_embeddings, not any original
        return RopeSpec(theta=theta, kind="dynamic", factor=params.number("factor"),
                        original_max_positions=max_positions)
    if kind not in ("llama3", "yarn", "longrope"):
        raise UnsupportedModel(f"rope type {kind!r} is not supported "
                               "(supported: default, linear, llama3, yarn, longrope, dynamic)")
    # The pretraining context: a top-level key wins over the section's (transformers' standardize_rope_params,
    # for Phi-3's configs, whose config class defaults it to 4096), else max_position_embeddings.
    top_level = PHI3_ORIGINAL_DEFAULT if phi3 else None
    if reader.get("original_max_position_embeddings", top_level) is not None:
        original = reader.count("original_max_position_embeddings", top_level)
    else:
        original = params.count("original_max_position_embeddings", max_positions)
    if kind == "llama3":
        return RopeSpec(theta=theta, kind="llama3", factor=params.number("factor"),
                        low_freq_factor=params.number("low_freq_factor"),
                        high_freq_factor=params.number("high_freq_factor"), original_max_positions=original)
    # yarn and longrope: a missing factor is the context's growth; it sets the default attention factor
    factor = max_positions / original if params.config.get("factor") is None else params.number("factor")
    attention = params.config.get("attention_factor")
    if kind == "longrope":
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        return RopeSpec(theta=theta, kind="longrope", original_max_positions=original,
                        attention_factor=f32_decimal(params.number("attention_factor", attention)),
                        short_factors=_factors(params, "short_factor"), long_factors=_factors(params, "long_factor"))
    if attention is None:
        mscale, mscale_all_dim = (params.config.get(k) for k in ("mscale", "mscale_all_dim"))
        if mscale and mscale_all_dim:
            attention = (yarn_mscale(factor, params.number("mscale", mscale)) /
                         yarn_mscale(factor, params.number("mscale_all_dim", mscale_all_dim)))
        else:
            attention = yarn_mscale(factor)
    return RopeSpec(theta=theta, kind="yarn", factor=factor, original_max_positions=original,
                    attention_factor=f32_decimal(params.number("attention_factor", attention)),
                    # transformers takes 0 or null as the default, hence ``or``
                    beta_fast=params.number("beta_fast", params.config.get("beta_fast") or 32.0),
                    beta_slow=params.number("beta_slow", params.config.get("beta_slow") or 1.0),
                    truncate=params.get("truncate", True, bool))


def _factors(params: ConfigReader, key: str) -> tuple[float, ...]:
    """LongRoPE's list of per-frequency divisors, each a positive number (used as float32)."""
    values = params.get(key, None, list)
    if values is None:
        raise UnsupportedModel(f"{params.where} lacks required key {key!r}")
    return tuple(f32_decimal(params.number(f"{key}[{i}]", v)) for i, v in enumerate(values))
