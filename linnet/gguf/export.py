"""Write a GGUF file that llama.cpp loads, for each family in llama.cpp's graph of it (Mistral as
``llama``, Mixtral as ``llama`` with its experts), in f32, f16, bf16 or q8_0 (MXFP4, gpt-oss's usual
experts, is read but not written).

What is about to be written is first read back through ``linnet.gguf.reader.spec_from_metadata``: a model
the file would describe otherwise (a feature that family's GGUF metadata has no key for, or that llama.cpp
derives instead of reading) is refused, naming the fields, before anything is written. Tensors are
converted and written one at a time (the directory of sizes is known up front), so memory stays at one
tensor beyond the model. The file is written under a temporary name and renamed at the end.
"""
from __future__ import annotations

from dataclasses import replace
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGUFValueType, GGUFWriter, LlamaFileType
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from linnet.arch import Packed, get_architecture
from linnet.arch.blocks import check_reads_back
from linnet.errors import LinnetError, UnsupportedModel
from linnet.files import atomic_write, check_output
from linnet.gguf.reader import LONGROPE_FAMILIES, ROPE_FACTORS, ROPE_FREQS, spec_from_metadata
from linnet.gguf.rope import llama3_factors, rope_permute
from linnet.gguf.tokenizer import GGUFVocab, gguf_vocab
from linnet.loaded_model import LoadedModel
from linnet.names import gguf_name
from linnet.spec import ModelSpec, RopeSpec, f32_decimal, yarn_mscale
from linnet.weights import Weights

TYPES = {"f32": (Q.F32, LlamaFileType.ALL_F32), "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
         "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16), "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0)}
ROPE_FREQS_FAMILIES = ("llama", "granite")  # the graphs that apply rope_freqs.weight (Llama 3 scaling)
VALUE_TYPES = {bool: GGUFValueType.BOOL, int: GGUFValueType.UINT32, float: GGUFValueType.FLOAT32,
               str: GGUFValueType.STRING}
Tensor = tuple[tuple[str, ...], Packed | None, tuple[int, ...], Q]  # canonical parts, their pack, shape, type


# llama.cpp takes a model whose general.name holds one of these for Phi-3 and sets Phi-3's token attributes,
# looking its tokens up by text (llama-vocab.cpp): a vocabulary without them fails to load ("unordered_map::at")
PHI3_NAME_MARKS = ("phi-3", "phi3")
PHI3_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")


def export_gguf(model: LoadedModel, out_file: str | Path, type: str, force: bool = False,
                name: str | None = None) -> Path:
    """Write ``model`` as one GGUF file; matrices in ``type``, norms and biases in f32 as llama.cpp does;
    ``general.name`` is ``name`` (by default the model's file or directory name). An existing ``out_file``
    is replaced only with ``force``."""
    if type not in TYPES:
        raise LinnetError(f"unknown GGUF type {type!r}; choose from {', '.join(TYPES)}")
    spec, tokenizer = model.spec, model.tokenizer
    if tokenizer is None:
        raise UnsupportedModel(f"{model.path} has no tokenizer, and a GGUF file must carry one")
    _refuse_rope(spec)
    eos_ids = model.eos_ids
    if len(eos_ids) > 3:
        raise UnsupportedModel(f"GGUF holds at most three end-of-generation ids (eos, eot, eom), not {list(eos_ids)}")
    metadata = model_metadata(spec, eos_ids)
    rope_tensors = _rope_tensors(spec)
    qtype, file_type = TYPES[type]
    tensors = _tensors(spec, model.weights, qtype)
    _check_reads_back(spec, eos_ids, metadata, {name: t[2] for name, t in tensors.items()}, rope_tensors)
    check_output(out_file, force)
    vocab = gguf_vocab(tokenizer, spec.vocab_size)
    if name is None:  # a directory's whole name: "Qwen2.5-0.5B-Instruct" has no suffix to drop
        name = model.path.name if model.path.is_dir() else model.path.stem
    _check_name(name, vocab.tokens)
    return atomic_write(out_file, lambda tmp: _write(tmp, model, name, file_type, metadata, rope_tensors, tensors,
                                                     vocab))


def _check_name(name: str, tokens: list[str]) -> None:
    """Refuse a name that makes llama.cpp look for Phi-3's tokens in a vocabulary without them."""
    if not name.strip():
        raise LinnetError("the GGUF file's name (general.name) must not be empty")
    if any(mark in name.lower() for mark in PHI3_NAME_MARKS):
        missing = [t for t in PHI3_TOKENS if t not in set(tokens)]
        if missing:
            raise UnsupportedModel(
                f"llama.cpp takes a model named {name!r} (holding 'phi-3' or 'phi3') for Phi-3 and looks up Phi-3's "
                f"tokens {', '.join(missing)}, which this vocabulary lacks: it would fail to load the file. Give "
                "the file another name (--name)")


def _refuse_rope(spec: ModelSpec) -> None:
    """Rope scaling that llama.cpp's graph of the family does not apply, or applies otherwise."""
    rope, family = spec.rope, spec.family
    if rope.kind == "llama3" and family not in ROPE_FREQS_FAMILIES:
        raise UnsupportedModel(f"llama.cpp's {family} graph has no Llama 3 rope scaling")
    if rope.kind == "dynamic":
        raise UnsupportedModel("llama.cpp has no dynamic NTK rope scaling")
    if rope.kind == "longrope" and family not in LONGROPE_FAMILIES:
        raise UnsupportedModel(f"llama.cpp's {family} graph has no LongRoPE factors (Linnet writes them for "
                               f"{', '.join(LONGROPE_FAMILIES)})")
    if rope.kind == "yarn" and not rope.truncate:
        raise UnsupportedModel("llama.cpp's YaRN rounds its correction range out to whole dims; this model's "
                               "rope scaling has truncate=false")
    if rope.kind == "yarn" and (rope.beta_fast, rope.beta_slow) != (32.0, 1.0):
        raise UnsupportedModel(f"llama.cpp's {family} graph runs YaRN with beta_fast 32 and beta_slow 1, not this "
                               f"model's {rope.beta_fast:g} and {rope.beta_slow:g}")


def _rope_tensors(spec: ModelSpec) -> dict[str, np.ndarray]:
    """llama.cpp's rope tensors: Llama 3 scaling's divisors, or LongRoPE's short and long factors."""
    if spec.rope.kind == "llama3":
        return {ROPE_FREQS: llama3_factors(spec.rope, spec.head_dim)}
    if spec.rope.kind == "longrope":
        return {ROPE_FACTORS["short"]: np.array(spec.rope.short_factors, np.float32),
                ROPE_FACTORS["long"]: np.array(spec.rope.long_factors, np.float32)}
    return {}


def model_metadata(spec: ModelSpec, eos_ids: tuple[int, ...]) -> dict[str, Any]:
    """The GGUF keys that describe the model (all but the file's and the tokenizer's own)."""
    family = spec.family
    eps = "layer_norm_epsilon" if spec.norm == "layer" else "layer_norm_rms_epsilon"
    keys: dict[str, Any] = {
        "context_length": spec.max_positions, "embedding_length": spec.hidden_size, "block_count": spec.num_layers,
        "feed_forward_length": spec.intermediate_size, "attention.head_count": spec.num_heads,
        "attention.head_count_kv": spec.num_kv_heads, "attention.key_length": spec.head_dim,
        "attention.value_length": spec.head_dim, "rope.dimension_count": spec.rotary_dim,
        f"attention.{eps}": float(spec.rms_norm_eps), "rope.freq_base": float(spec.rope.theta),
        "vocab_size": spec.vocab_size,
    }
    keys |= _rope_keys(spec)
    keys |= get_architecture(spec.architecture).gguf_metadata(spec)
    ids = {"bos": spec.bos_token_id, **dict(zip(("eos", "eot", "eom"), eos_ids))}
    return {"general.architecture": family, **{f"{family}.{k}": v for k, v in keys.items()},
            **{f"tokenizer.ggml.{k}_token_id": i for k, i in ids.items() if i is not None}}


def _rope_keys(spec: ModelSpec) -> dict[str, Any]:
    rope = spec.rope
    if rope.kind == "linear":
        return {"rope.scaling.type": "linear", "rope.scaling.factor": float(rope.factor)}
    if rope.kind == "yarn":  # llama.cpp scales cos and sin by 0.1 ln(factor) + 1 itself; attn_factor by the rest
        return {"rope.scaling.type": "yarn", "rope.scaling.factor": float(rope.factor),
                "rope.scaling.original_context_length": rope.original_max_positions, **_yarn_attn_factor(rope)}
    if rope.kind == "longrope":  # as llama.cpp's converter writes Phi-3's: no scaling type, the factors as tensors
        return {"rope.scaling.original_context_length": rope.original_max_positions,
                "rope.scaling.attn_factor": float(rope.attention_factor)}
    return {}


def _yarn_attn_factor(rope: RopeSpec) -> dict[str, float]:
    """rope.scaling.attn_factor for a YaRN attention factor other than its default: of the float32 values
    nearest the quotient, one the reader's float32 product turns back into the factor (if none, the
    read-back check names the difference)."""
    target, mscale = np.float32(rope.attention_factor), yarn_mscale(rope.factor)
    if np.float32(f32_decimal(mscale)) == target:
        return {}
    attn = np.float32(rope.attention_factor / mscale)
    near = (attn, np.nextafter(attn, np.float32(np.inf)), np.nextafter(attn, np.float32(0)))
    fits = [a for a in near if np.float32(mscale * f32_decimal(float(a))) == target]
    return {"rope.scaling.attn_factor": float(fits[0] if fits else attn)}


def _tensors(spec: ModelSpec, weights: Weights, qtype: Q) -> dict[str, Tensor]:
    """Each GGUF tensor to write: llama.cpp's packed ones stack their parts' rows."""
    packed: dict[str, tuple[str | None, tuple[str, ...], Packed | None]] = {}
    for template, packing in get_architecture(spec.architecture).gguf_packed.items():
        for packed_name, group in packing.groups(spec, template, weights):
            packed.update(dict.fromkeys(group, (packed_name, group, packing)))
    tensors: dict[str, Tensor] = {}
    for canonical, array in weights.items():
        name, parts, pack = packed.get(canonical, (gguf_name(spec, canonical), (canonical,), None))
        assert name is not None, canonical  # a part without a GGUF name of its own is in a packed tensor
        if name not in tensors:
            shape = (sum(weights[p].shape[0] for p in parts), *array.shape[1:])
            tensors[name] = (parts, pack, shape, _tensor_type(parts[0], shape, qtype))
    return tensors


def _check_reads_back(spec: ModelSpec, eos_ids: tuple[int, ...], metadata: dict[str, Any],
                      shapes: dict[str, tuple[int, ...]], rope_tensors: dict[str, np.ndarray]) -> None:
    """The file would give the model's spec (floats as float32; Mistral as Llama), or an error naming
    what differs."""
    back = spec_from_metadata(metadata, shapes, rope_tensors, f"the GGUF of {spec.architecture}")
    check_reads_back(replace(spec, eos_token_ids=eos_ids, dtype=back.dtype),
                     replace(back, architecture=spec.architecture),  # one family: Mistral's reads back as Llama
                     f"GGUF's {spec.family} form (as llama.cpp reads it)", float32=True)


def _write(path: Path, model: LoadedModel, name: str, file_type: LlamaFileType, metadata: dict[str, Any],
           rope_tensors: dict[str, np.ndarray], tensors: dict[str, Tensor], vocab: GGUFVocab) -> None:
    spec, tokenizer = model.spec, model.tokenizer
    assert tokenizer is not None  # export_gguf refuses a model without one
    writer = GGUFWriter(path, arch=spec.family)
    try:
        writer.add_name(name)
        writer.add_file_type(file_type)
        writer.add_quantization_version(GGML_QUANT_VERSION)
        for key, value in metadata.items():
            if key != "general.architecture":  # the writer's own
                writer.add_key_value(key, value, VALUE_TYPES[type(value)])
        vocab.write(writer)
        if tokenizer.chat_template:
            writer.add_chat_template(tokenizer.chat_template)

        for name, array in rope_tensors.items():  # llama.cpp applies Llama 3 scaling and LongRoPE through these
            writer.add_tensor_info(name, array.shape, array.dtype, array.nbytes, Q.F32)
        for name, (_, _, shape, tensor_type) in tensors.items():
            writer.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(shape, tensor_type), tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for array in rope_tensors.values():
            writer.write_tensor_data(array)
        for parts, pack, _, tensor_type in tensors.values():
            if pack is None:
                array = rope_permute(spec, parts[0], model.weights[parts[0]])
            else:
                array = pack.pack(spec, tuple(model.weights[p] for p in parts))
            writer.write_tensor_data(_encode(array, tensor_type))
    finally:
        writer.close()


KEPT_F32 = ("router", "shared_expert_gate")  # as llama.cpp's converters keep them: rounding may change the experts


def _tensor_type(canonical: str, shape: tuple[int, ...], wanted: Q) -> Q:
    """Vectors, biases (an expert's too) and routers stay f32; a matrix whose rows are not whole q8_0 blocks
    falls back to f16, as in llama.cpp."""
    part = canonical.rsplit(".", 1)[-1]
    if len(shape) == 1 or part.endswith("bias") or part in KEPT_F32:
        return Q.F32
    if shape[-1] % GGML_QUANT_SIZES[wanted][0]:
        return Q.F16
    return wanted


def _nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return prod(shape) // block * size


def _encode(array: np.ndarray, qtype: Q) -> np.ndarray:
    """The stored bytes (or values) of ``array`` as ``qtype``; gguf rounds bf16 to nearest even, as torch does."""
    return quantize(array.astype(np.float32, copy=False), qtype)
