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
    """Rotary embedding: plain (``default``) or Llama 3 frequency scaling (``llama3``)."""

    theta: float
    kind: str = "default"  # "default" | "llama3"
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
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    dtype: str = "f32"  # the checkpoint's dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

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
        ids = [self.bos_token_id, *self.eos_token_ids]
        if any(i is not None and (type(i) is not int or not 0 <= i < self.vocab_size) for i in ids):
            raise UnsupportedModel(f"token ids {ids} (bos, eos) must be in the vocabulary of {self.vocab_size}")

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
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias
        attn += 2 * self.head_dim * self.qk_norm
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * layer + h + head

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
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
    reader = _ConfigReader(config, where)
    names = reader.get("architectures", [], list)
    if len(names) != 1 or not isinstance(names[0], str):
        raise UnsupportedModel(f"{where} must name exactly one architecture, found {names!r}")
    arch = get_architecture(names[0])
    if reader.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act={config['hidden_act']!r} is not supported (only 'silu')")
    if reader.get("mlp_bias", False):
        raise UnsupportedModel("mlp_bias=true is not supported")
    if reader.get("use_sliding_window", False):
        raise UnsupportedModel("use_sliding_window=true (sliding-window attention) is not supported")
    layer_types = reader.get("layer_types", [], list)
    if layer_types and layer_types != ["full_attention"] * len(layer_types):
        raise UnsupportedModel(f"layer_types {sorted(set(map(str, layer_types)))} are not supported "
                               "(only full_attention)")
    hidden = reader.count("hidden_size")
    heads = reader.count("num_attention_heads")
    head_dim = reader.count("head_dim", hidden // heads)
    eos = reader.get("eos_token_id", [], (int, list))
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    dtype = reader.get("dtype", None, str) or reader.get("torch_dtype", "float32", str)
    if dtype not in BY_HF:
        raise UnsupportedModel(f"checkpoint dtype {dtype!r} is not supported")
    return ModelSpec(
        architecture=arch.name,
        vocab_size=reader.count("vocab_size"),
        hidden_size=hidden,
        intermediate_size=reader.count("intermediate_size"),
        num_layers=reader.count("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=reader.count("num_key_value_heads", heads),
        head_dim=head_dim,
        rms_norm_eps=reader.number("rms_norm_eps"),
        rope=_rope_from_config(reader),
        max_positions=reader.count("max_position_embeddings"),
        tie_word_embeddings=bool(reader.get("tie_word_embeddings", arch.tied_by_default)),
        dtype=BY_HF[dtype].name,
        bos_token_id=reader.get("bos_token_id", None, int),
        eos_token_ids=eos_ids,
        **arch.attention_flags(reader),
    )


class _ConfigReader:
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


def _rope_from_config(reader: _ConfigReader) -> RopeSpec:
    # transformers 5 writes rope_parameters (theta inside); transformers 4 writes rope_theta + rope_scaling.
    params = {**reader.get("rope_scaling", {}, dict), **reader.get("rope_parameters", {}, dict)}
    theta = params.get("rope_theta", reader.config.get("rope_theta"))
    if theta is None:
        raise UnsupportedModel(f"{reader.where} lacks rope_theta (or rope_parameters.rope_theta)")
    theta = reader.number("rope_theta", theta)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeSpec(theta=theta)
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
    raise UnsupportedModel(f"rope type {kind!r} is not supported (supported: default, llama3)")
