"""ModelSpec: one typed, frozen description of a decoder-only model, every dimension explicit.

A spec is read from a Hugging Face ``config.json`` (transformers 4 and 5 spellings) or from GGUF
metadata. Llama, Qwen2 and Qwen3 differ only in the data held here, never in code paths.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from linnet.dtypes import BY_HF, DTYPES
from linnet.errors import UnsupportedModel
from linnet.files import naming, read_json

MAX_LAYERS = 1024  # no published decoder has a quarter as many; bounds what a checkpoint makes Linnet allocate


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding: plain (``default``), positions slowed by ``factor`` (``linear``), or Llama 3
    frequency scaling (``llama3``)."""

    theta: float
    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_positions: int = 0


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
        for name, value in (("rms_norm_eps", self.rms_norm_eps), ("rope theta", self.rope.theta)):
            if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
                raise UnsupportedModel(f"{name} must be a finite, positive number, got {value!r}")
        if self.dtype not in DTYPES:
            raise UnsupportedModel(f"unsupported dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        self._check_family_fields()
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
            raise UnsupportedModel(f"rotary dimension {self.rope_dim!r} must be even and within head_dim {self.head_dim}")
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

    @property
    def rotary_dim(self) -> int:
        return self.head_dim if self.rope_dim is None else self.rope_dim

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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("eos_token_ids", "layer_types", "nope_layers"):
            d[name] = list(d[name])
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
    fields = dict(
        architecture=arch.name,
        vocab_size=reader.count("vocab_size"),
        hidden_size=hidden,
        intermediate_size=reader.count("intermediate_size"),
        num_layers=reader.count("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=reader.count("num_key_value_heads", heads),
        head_dim=head_dim,
        rms_norm_eps=reader.number(arch.eps_key),
        rope=_rope_from_config(reader),
        max_positions=reader.count("max_position_embeddings"),
        tie_word_embeddings=bool(reader.get("tie_word_embeddings", arch.tied_by_default)),
        dtype=BY_HF[dtype].name,
        bos_token_id=reader.get("bos_token_id", None, int),
        eos_token_ids=eos_ids,
    )
    return ModelSpec(**{**fields, **arch.read_config(reader)})


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


def _rope_from_config(reader: ConfigReader) -> RopeSpec:
    # transformers 5 writes rope_parameters (theta inside); transformers 4 writes rope_theta + rope_scaling.
    params = {**reader.get("rope_scaling", {}, dict), **reader.get("rope_parameters", {}, dict)}
    theta = params.get("rope_theta", reader.config.get("rope_theta"))
    if theta is None:
        raise UnsupportedModel(f"{reader.where} lacks rope_theta (or rope_parameters.rope_theta)")
    theta = reader.number("rope_theta", theta)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=reader.number("rope_scaling.factor", params.get("factor")))
    if kind == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if params.get(k) is None]
        if missing:
            raise UnsupportedModel(f"llama3 rope scaling lacks {missing[0]!r}")
        original = params["original_max_position_embeddings"]
        if type(original) is not int or original < 1:
            raise reader.fail("rope_scaling.original_max_position_embeddings",
                              f"expected a positive integer, got {original!r}")
        return RopeSpec(
            theta=theta,
            kind="llama3",
            factor=reader.number("rope_scaling.factor", params["factor"]),
            low_freq_factor=reader.number("rope_scaling.low_freq_factor", params["low_freq_factor"]),
            high_freq_factor=reader.number("rope_scaling.high_freq_factor", params["high_freq_factor"]),
            original_max_positions=original,
        )
    raise UnsupportedModel(f"rope type {kind!r} is not supported (supported: default, linear, llama3)")
