"""ModelSpec: one typed, frozen description of a decoder-only model, every dimension explicit.

A spec is read from a Hugging Face ``config.json`` (transformers 4 and 5 spellings) or from GGUF
metadata. Llama, Qwen2 and Qwen3 differ only in the data held here, never in code paths.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from linnet.dtypes import BY_HF, DTYPES
from linnet.errors import UnsupportedModel


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
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.dtype not in DTYPES:
            raise UnsupportedModel(f"unsupported dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")

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
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModel(f"{path} is not valid JSON: {e}") from None
    return spec_from_hf_config(config)


def spec_from_hf_config(config: dict[str, Any]) -> ModelSpec:
    from linnet.arch import get_architecture

    names = config.get("architectures") or []
    if len(names) != 1:
        raise UnsupportedModel(f"config.json must name exactly one architecture, found {names!r}")
    arch = get_architecture(names[0])
    reader = _ConfigReader(config)
    if reader.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act={config['hidden_act']!r} is not supported (only 'silu')")
    if reader.get("mlp_bias", False):
        raise UnsupportedModel("mlp_bias=true is not supported")
    if reader.get("use_sliding_window", False):
        raise UnsupportedModel("use_sliding_window=true (sliding-window attention) is not supported")
    layer_types = reader.get("layer_types", None)
    if layer_types and set(layer_types) != {"full_attention"}:
        raise UnsupportedModel(f"layer_types {sorted(set(layer_types))} are not supported (only full_attention)")
    hidden = reader.require("hidden_size")
    heads = reader.require("num_attention_heads")
    head_dim = reader.get("head_dim", None) or hidden // heads
    eos = reader.get("eos_token_id", None)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    dtype = reader.get("dtype", None) or reader.get("torch_dtype", None) or "float32"
    if dtype not in BY_HF:
        raise UnsupportedModel(f"checkpoint dtype {dtype!r} is not supported")
    return ModelSpec(
        architecture=arch.name,
        vocab_size=reader.require("vocab_size"),
        hidden_size=hidden,
        intermediate_size=reader.require("intermediate_size"),
        num_layers=reader.require("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=reader.get("num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=float(reader.require("rms_norm_eps")),
        rope=_rope_from_config(config),
        max_positions=reader.require("max_position_embeddings"),
        tie_word_embeddings=bool(reader.get("tie_word_embeddings", arch.tied_by_default)),
        dtype=BY_HF[dtype].name,
        bos_token_id=reader.get("bos_token_id", None),
        eos_token_ids=eos_ids,
        **arch.attention_flags(reader),
    )


class _ConfigReader:
    """Reads config keys; ``require`` names the missing key instead of guessing a default."""

    def __init__(self, config: dict[str, Any]):
        self.config = config

    def get(self, key: str, default: Any) -> Any:
        value = self.config.get(key, default)
        return default if value is None else value

    def require(self, key: str) -> Any:
        if self.config.get(key) is None:
            raise UnsupportedModel(f"config.json lacks required key {key!r}")
        return self.config[key]


def _rope_from_config(config: dict[str, Any]) -> RopeSpec:
    # transformers 5 writes rope_parameters (theta inside); transformers 4 writes rope_theta + rope_scaling.
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", config.get("rope_theta"))
    if theta is None:
        raise UnsupportedModel("config.json lacks rope_theta (or rope_parameters.rope_theta)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeSpec(theta=float(theta))
    if kind == "llama3":
        try:
            return RopeSpec(
                theta=float(theta),
                kind="llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_positions=int(params["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise UnsupportedModel(f"llama3 rope scaling lacks {e.args[0]!r}") from None
    raise UnsupportedModel(f"rope type {kind!r} is not supported (supported: default, llama3)")
