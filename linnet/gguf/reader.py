"""Load a GGUF file of any family Linnet has an architecture for, as llama.cpp's graph of that family
reads it, as a ModelSpec, float32 Weights and a Tokenizer.

Quantised tensors are dequantised once (``dequantise``); the result is kept in the converted-weights
cache, keyed by the file's identity and the dequantising code, so later loads map it instead.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from linnet.arch import Packed, architecture_for_family, get_architecture
from linnet.errors import UnsupportedModel, WeightError
from linnet.files import naming
from linnet.gguf import dequantise
from linnet.gguf.blocks import GGUFWeights
from linnet.gguf.format import GGUFFile
from linnet.gguf.rope import llama3_from_factors
from linnet.gguf.tokenizer import tokenizer_from_gguf
from linnet.loaded_model import LoadedModel
from linnet.names import expected_shapes, gguf_name
from linnet.spec import ModelSpec, RopeSpec, f32_decimal, yarn_mscale
from linnet.tokenizer import Tokenizer
from linnet.weight_cache import cached_arrays, source_identity
from linnet.weights import check_shapes

# The types tested against llama.cpp (MXFP4: gpt-oss's experts); the i-quants and ternary types are refused
# rather than trusted.
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
                             Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4})
ROPE_FREQS = "rope_freqs.weight"  # Llama 3 scaling's divisors
ROPE_FACTORS = {"short": "rope_factors_short.weight", "long": "rope_factors_long.weight"}  # LongRoPE's (Phi-3)
ROPE_TENSORS = (ROPE_FREQS, *ROPE_FACTORS.values())
LONGROPE_FAMILIES = ("phi3",)  # the graphs Linnet reads and writes LongRoPE factors for
PlanEntry = tuple[tuple[str, ...], Packed | None]


def load_gguf(path: str | Path) -> LoadedModel:
    start = time.perf_counter()
    path = Path(path)
    with naming(path):
        return _load(path, start)


def _load(path: Path, start: float) -> LoadedModel:
    gguf = GGUFFile(path)
    spec = spec_from_gguf(gguf)
    plan = tensor_plan(spec)
    unknown = sorted(set(gguf.tensors) - set(plan) - set(ROPE_TENSORS))
    if unknown:
        raise UnsupportedModel(f"{path.name} has tensors Linnet does not know: {', '.join(unknown[:5])}")
    present = {name: entry for name, entry in plan.items() if name in gguf.tensors}
    for name in present:  # types, names and shapes are checked before anything is dequantised or cached
        if gguf.tensors[name].type not in SUPPORTED_TYPES:
            raise WeightError(f"tensor {name!r} is stored as {gguf.tensors[name].type.name}, which Linnet "
                              f"cannot read; supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")
    check_shapes(spec, _canonical_shapes(spec, gguf, present))
    tokenizer = _tokenizer(gguf) if "tokenizer.ggml.model" in gguf.metadata else None
    unpacking = sorted({pack.unpack.__module__ for _, pack in present.values() if pack is not None})
    file, key = source_identity([path]), f"dequantised by {dequantise.code(*(sys.modules[m] for m in unpacking))}"
    # The weights are this file as this code dequantises it (when first read as floats; its Q8_0/Q4_0/Q4_1
    # tensors are also given as stored, linnet.gguf.blocks): plans of them are keyed by both.
    def dequantise_all() -> dict[str, np.ndarray]:
        return cached_arrays(file, key, lambda: dequantise.dequantised(gguf, spec, present))

    weights = GGUFWeights(spec, gguf, present, dequantise_all, time.perf_counter() - start, f"{file}\n{key}")
    return LoadedModel(spec, weights, tokenizer, path)


def tensor_plan(spec: ModelSpec) -> dict[str, PlanEntry]:
    """Every GGUF tensor the spec's weights come from -> (its canonical parts, the architecture's
    ``Packed`` for a tensor llama.cpp keeps packed, else None)."""
    needed = expected_shapes(spec)
    plan: dict[str, PlanEntry] = {name: ((c,), None) for c in needed if (name := gguf_name(spec, c)) is not None}
    for template, pack in get_architecture(spec.architecture).gguf_packed.items():
        plan.update({name: (parts, pack) for name, parts in pack.groups(spec, template, needed)})
    return plan


def _canonical_shapes(spec: ModelSpec, gguf: GGUFFile, present: dict[str, PlanEntry]) -> dict[str, Any]:
    """Each canonical tensor's shape as the file holds it (a packed tensor's rows split as unpacking would)."""
    shapes: dict[str, Any] = {}
    for name, (parts, pack) in present.items():
        shape = gguf.tensors[name].shape
        if pack is None:
            shapes[parts[0]] = gguf.tensors[name]
            continue
        try:
            pieces = pack.unpack(spec, np.broadcast_to(np.zeros((), np.uint8), shape))
        except ValueError:
            raise WeightError(f"tensor {name!r} of shape {list(shape)} does not hold {', '.join(parts)} "
                              "in the model's shapes") from None
        shapes.update(zip(parts, pieces))
    return shapes


def spec_from_gguf(gguf: GGUFFile) -> ModelSpec:
    with naming(gguf.path):
        rope_tensors = {}
        for name in ROPE_TENSORS:
            info = gguf.tensors.get(name)
            if info is not None and info.type != Q.F32:
                raise WeightError(f"{gguf.path}: {name} is {info.type.name}, expected F32")
            if info is not None:
                rope_tensors[name] = dequantize(gguf.raw(name), Q.F32)
        shapes = {name: info.shape for name, info in gguf.tensors.items()}
        return spec_from_metadata(gguf.metadata, shapes, rope_tensors, str(gguf.path))


class GGUFKeys:
    """A GGUF file's ``{family}.*`` metadata, each value checked for its type, and its tensor names: what
    an architecture's ``gguf_config`` reads."""

    def __init__(self, meta: dict[str, Any], tensors: Collection[str], family: str, where: str):
        self.meta, self.tensors, self.family, self.where = meta, tensors, family, where

    def number(self, name: str, default: Any = None, kind: type = int) -> Any:
        """A whole number of at least 1 (``kind`` int) or a finite, positive number (``kind`` float, as
        the shortest decimal of its float32); required unless there is a default."""
        value = self.meta.get(f"{self.family}.{name}", default)
        if value is None:
            raise UnsupportedModel(f"{Path(self.where).name} lacks metadata key {self.family}.{name}")
        if isinstance(value, list):
            raise UnsupportedModel(f"{self.family}.{name} differs per layer; Linnet supports uniform layers only")
        if type(value) not in ((int,) if kind is int else (int, float)) or not 0 < value < float("inf"):
            what = "a positive integer" if kind is int else "a finite, positive number"
            raise UnsupportedModel(f"{self.where}: {self.family}.{name}: expected {what}, got {value!r}")
        return value if kind is int else _f32(value)

    def optional(self, name: str, kind: type = float) -> Any:
        """``number``, or None where the key is absent."""
        return self.number(name, kind=kind) if f"{self.family}.{name}" in self.meta else None

    def flag(self, name: str, default: bool) -> bool:
        value = self.meta.get(f"{self.family}.{name}", default)
        if type(value) is not bool:
            raise UnsupportedModel(f"{self.where}: {self.family}.{name}: expected true or false, got {value!r}")
        return value

    def has(self, tensor: str) -> bool:
        return tensor in self.tensors


def spec_from_metadata(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                       rope_tensors: dict[str, np.ndarray], where: str) -> ModelSpec:
    """The spec a GGUF's metadata and tensor shapes describe (``rope_tensors``: those of ROPE_TENSORS it has).
    The exporter reads what it is about to write through this too, so both agree by construction."""
    family = meta.get("general.architecture")
    if not isinstance(family, str):
        raise UnsupportedModel(f"{where}: general.architecture: expected a name, got {family!r}")
    # llama.cpp names Mixtral's family "llama": the expert count tells it from Llama
    arch = architecture_for_family(family, experts=bool(meta.get(f"{family}.expert_count")))
    keys = GGUFKeys(meta, shapes, family, where)
    if "token_embd.weight" not in shapes:
        raise WeightError(f"{Path(where).name} has no token_embd.weight")
    hidden, heads = keys.number("embedding_length"), keys.number("attention.head_count")
    head_dim = keys.number("attention.key_length", hidden // heads)  # llama.cpp's default too
    if keys.number("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModel("attention.value_length differs from key_length; not supported")
    rope_dim = keys.number("rope.dimension_count", head_dim)
    if rope_dim != head_dim and arch.gguf_interleaved_rope:
        raise UnsupportedModel(f"{where}: partial rotary (rope.dimension_count {rope_dim} of head_dim {head_dim}) "
                               f"in llama.cpp's {family} graph is not supported")
    fields = arch.gguf_config(keys)
    eps = "attention.layer_norm_epsilon" if fields.get("norm") == "layer" else "attention.layer_norm_rms_epsilon"
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelSpec(
        architecture=arch.name,
        vocab_size=shapes["token_embd.weight"][0],
        hidden_size=hidden,
        intermediate_size=keys.number("feed_forward_length"),
        num_layers=keys.number("block_count"),
        num_heads=heads,
        num_kv_heads=keys.number("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=keys.number(eps, kind=float),
        rope=_rope(keys, head_dim, rope_dim, rope_tensors),
        max_positions=keys.number("context_length"),
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(i for i in eos if i is not None),
        rope_dim=None if rope_dim == head_dim else rope_dim,
        **fields,
    )


def _rope(keys: GGUFKeys, head_dim: int, rope_dim: int, tensors: dict[str, np.ndarray]) -> RopeSpec:
    """Rope scaling as llama.cpp applies it: the scaling type's keys, ``rope.scaling.attn_factor`` (which
    llama.cpp multiplies cos and sin by whatever the type), and the rope tensors."""
    theta = keys.number("rope.freq_base", 10000.0, float)  # llama.cpp's default when the key is absent
    scaling = keys.meta.get(f"{keys.family}.rope.scaling.type", "none")
    attn = keys.number("rope.scaling.attn_factor", 1.0, float)
    original = keys.number("rope.scaling.original_context_length", keys.number("context_length"))  # llama.cpp's
    if any(name in tensors for name in ROPE_FACTORS.values()) or scaling == "longrope":
        return _longrope(keys, rope_dim, theta, attn, original, tensors)
    if scaling == "yarn":
        return _yarn(keys, theta, attn, original)
    if attn != 1.0:
        raise UnsupportedModel(f"{keys.where}: {keys.family}.rope.scaling.attn_factor {attn} scales cos and sin; "
                               f"Linnet has that for YaRN and LongRoPE only, not rope scaling {scaling!r}")
    if scaling == "linear":
        return RopeSpec(theta=theta, kind="linear", factor=keys.number("rope.scaling.factor", kind=float))
    if scaling != "none":
        raise UnsupportedModel(f"rope scaling {scaling!r} is not supported (none, linear, yarn, longrope)")
    factors = tensors.get(ROPE_FREQS)
    if factors is None:
        return RopeSpec(theta=theta)
    if factors.shape != (head_dim // 2,):
        raise WeightError(f"{keys.where}: {ROPE_FREQS} has shape {list(factors.shape)}, expected [{head_dim // 2}]")
    return llama3_from_factors(theta, head_dim, factors)


# YaRN keys whose meaning llama.cpp's families differ on (some graphs never read them, and llama.cpp versions
# apply yarn_attn_factor differently): read only where they say what every graph does without them.
YARN_DEFAULTS = {"rope.scaling.yarn_ext_factor": 1.0, "rope.scaling.yarn_attn_factor": 1.0,
                 "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0,
                 "rope.scaling.yarn_log_multiplier": 0.0}


def _yarn(keys: GGUFKeys, theta: float, attn: float, original: int) -> RopeSpec:
    """llama.cpp's YaRN: the ramp between beta_fast 32 and beta_slow 1 rotations, truncated to whole dims,
    cos and sin multiplied by 0.1 ln(factor) + 1 and by rope.scaling.attn_factor."""
    for name, default in YARN_DEFAULTS.items():
        value = keys.meta.get(f"{keys.family}.{name}", default)
        if value != default:
            raise UnsupportedModel(f"{keys.where}: {keys.family}.{name} is {value!r}; Linnet reads YaRN only as "
                                   f"every llama.cpp graph applies it, with {default}")
    factor = keys.number("rope.scaling.factor", kind=float)
    return RopeSpec(theta=theta, kind="yarn", factor=factor, original_max_positions=original,
                    attention_factor=f32_decimal(yarn_mscale(factor) * attn))


def _longrope(keys: GGUFKeys, rope_dim: int, theta: float, attn: float, original: int,
              tensors: dict[str, np.ndarray]) -> RopeSpec:
    """LongRoPE as llama.cpp's phi3 graph reads it: the short and long factors as tensors, the attention
    factor as rope.scaling.attn_factor. llama.cpp picks one set for a whole context (long when its
    context size exceeds original_context_length); Linnet per position (linnet.rope)."""
    if keys.family not in LONGROPE_FAMILIES:
        raise UnsupportedModel(f"{keys.where}: LongRoPE factors in llama.cpp's {keys.family} graph are not supported "
                               f"(only in {', '.join(LONGROPE_FAMILIES)})")
    factors = {}
    for which, name in ROPE_FACTORS.items():
        if name not in tensors:
            raise WeightError(f"{keys.where}: LongRoPE needs {name}, which the file lacks")
        if tensors[name].shape != (rope_dim // 2,):
            raise WeightError(f"{keys.where}: {name} has shape {list(tensors[name].shape)}, expected [{rope_dim // 2}]")
        if not np.all(np.isfinite(tensors[name]) & (tensors[name] > 0)):
            raise WeightError(f"{keys.where}: {name} holds factors that are not finite, positive numbers")
        factors[which] = tuple(_f32(v) for v in tensors[name])
    return RopeSpec(theta=theta, kind="longrope", original_max_positions=original, attention_factor=attn,
                    short_factors=factors["short"], long_factors=factors["long"])


# The tokenizer keys and their types, checked before linnet.gguf.tokenizer builds a tokenizer from them.
TOKENIZER_LISTS = {"tokenizer.ggml.tokens": str, "tokenizer.ggml.token_type": int, "tokenizer.ggml.merges": str,
                   "tokenizer.ggml.scores": float}
TOKEN_IDS = [f"tokenizer.ggml.{k}_token_id" for k in ("bos", "eos", "eot", "eom", "unknown")]


def _tokenizer(gguf: GGUFFile) -> Tokenizer:
    meta = gguf.metadata
    for name, kind in TOKENIZER_LISTS.items():
        value = meta.get(name, [])
        if not isinstance(value, list) or not all(type(v) is kind for v in value):
            raise UnsupportedModel(f"{gguf.path}: {name}: expected a list of {kind.__name__}s")
    bad = next((m for m in meta.get("tokenizer.ggml.merges", []) if len(m.split(" ")) != 2), None)
    if bad is not None:
        raise UnsupportedModel(f"{gguf.path}: tokenizer.ggml.merges: {bad!r} is not two tokens and a space")
    count = len(meta.get("tokenizer.ggml.tokens", []))
    for name in TOKEN_IDS:
        value = meta.get(name)
        if value is not None and (type(value) is not int or not 0 <= value < count):
            raise UnsupportedModel(f"{gguf.path}: {name}: {value!r} is not one of the {count} tokens")
    for name in ("tokenizer.ggml.pre", "tokenizer.chat_template"):
        if not isinstance(meta.get(name, ""), str):
            raise UnsupportedModel(f"{gguf.path}: {name}: expected a string, got {meta[name]!r}")
    tokenizer = tokenizer_from_gguf(meta)
    tokenizer.template_origin = f"{gguf.path}: tokenizer.chat_template"
    return tokenizer


def _f32(value: float) -> float:
    """The shortest decimal that is the same float32: GGUF's 9.999999747e-06 reads back as 1e-05."""
    return f32_decimal(value)
