"""Write a GGUF file that llama.cpp loads: llama, qwen2 or qwen3, in f32, f16, bf16 or q8_0.

Tensors are converted and written one at a time (the directory of sizes is known up front), so memory
stays at one tensor beyond the model. The file is written under a temporary name and renamed at the end.
"""
from __future__ import annotations

from math import prod
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGUFWriter, LlamaFileType
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from linnet.errors import LinnetError, UnsupportedModel
from linnet.files import atomic_write, check_output
from linnet.gguf.reader import ROPE_FREQS
from linnet.gguf.rope import llama3_factors, rope_permute
from linnet.gguf.tokenizer import GGUFVocab, gguf_vocab
from linnet.loaded_model import LoadedModel
from linnet.names import gguf_name

TYPES = {"f32": (Q.F32, LlamaFileType.ALL_F32), "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
         "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16), "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0)}


def export_gguf(model: LoadedModel, out_file: str | Path, type: str, force: bool = False) -> Path:
    """Write ``model`` as one GGUF file; matrices in ``type``, norms and biases in f32 as llama.cpp does.
    An existing ``out_file`` is replaced only with ``force``."""
    if type not in TYPES:
        raise LinnetError(f"unknown GGUF type {type!r}; choose from {', '.join(TYPES)}")
    spec, tokenizer = model.spec, model.tokenizer
    if tokenizer is None:
        raise UnsupportedModel(f"{model.path} has no tokenizer, and a GGUF file must carry one")
    if spec.rope.kind == "llama3" and spec.family != "llama":
        raise UnsupportedModel(f"llama.cpp's {spec.family} graph has no Llama 3 rope scaling")
    check_output(out_file, force)
    qtype, file_type = TYPES[type]
    tensors = {gguf_name(spec, c): (c, _tensor_type(a, qtype)) for c, a in model.weights.items()}
    vocab = gguf_vocab(tokenizer, spec.vocab_size)
    eos_ids = model.eos_ids
    if len(eos_ids) > 3:
        raise UnsupportedModel(f"GGUF holds at most three end-of-generation ids (eos, eot, eom), not {list(eos_ids)}")
    return atomic_write(out_file, lambda tmp: _write(tmp, model, file_type, tensors, vocab, eos_ids))


def _write(path: Path, model: LoadedModel, file_type: LlamaFileType, tensors: dict[str, tuple[str, Q]],
           vocab: GGUFVocab, eos_ids: tuple[int, ...]) -> None:
    spec, tokenizer = model.spec, model.tokenizer
    writer = GGUFWriter(path, arch=spec.family)
    try:
        writer.add_name(model.path.stem)
        writer.add_file_type(file_type)
        writer.add_quantization_version(GGML_QUANT_VERSION)
        writer.add_context_length(spec.max_positions)
        writer.add_embedding_length(spec.hidden_size)
        writer.add_block_count(spec.num_layers)
        writer.add_feed_forward_length(spec.intermediate_size)
        writer.add_head_count(spec.num_heads)
        writer.add_head_count_kv(spec.num_kv_heads)
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
        writer.add_rope_dimension_count(spec.head_dim)
        writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
        writer.add_rope_freq_base(spec.rope.theta)
        writer.add_vocab_size(spec.vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(vocab.pre)
        writer.add_token_list(vocab.tokens)
        writer.add_token_types(vocab.types)
        writer.add_token_merges(vocab.merges)
        writer.add_add_bos_token(vocab.add_bos)
        if spec.bos_token_id is not None:
            writer.add_bos_token_id(spec.bos_token_id)
        for add, i in zip((writer.add_eos_token_id, writer.add_eot_token_id, writer.add_eom_token_id), eos_ids):
            add(i)
        if tokenizer.chat_template:
            writer.add_chat_template(tokenizer.chat_template)

        rope_freqs = llama3_factors(spec.rope, spec.head_dim) if spec.rope.kind == "llama3" else None
        if rope_freqs is not None:  # llama.cpp applies Llama 3 scaling through this tensor
            writer.add_tensor_info(ROPE_FREQS, rope_freqs.shape, rope_freqs.dtype, rope_freqs.nbytes, Q.F32)
        for name, (canonical, tensor_type) in tensors.items():
            shape = model.weights[canonical].shape
            writer.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(shape, tensor_type), tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if rope_freqs is not None:
            writer.write_tensor_data(rope_freqs)
        for name, (canonical, tensor_type) in tensors.items():
            array = rope_permute(spec, canonical, model.weights[canonical])
            writer.write_tensor_data(_encode(array, tensor_type))
    finally:
        writer.close()


def _tensor_type(array: np.ndarray, wanted: Q) -> Q:
    """Vectors stay f32; a matrix whose rows are not whole q8_0 blocks falls back to f16, as in llama.cpp."""
    if array.ndim == 1:
        return Q.F32
    if array.shape[-1] % GGML_QUANT_SIZES[wanted][0]:
        return Q.F16
    return wanted


def _nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return prod(shape) // block * size


def _encode(array: np.ndarray, qtype: Q) -> np.ndarray:
    """The stored bytes (or values) of ``array`` as ``qtype``; gguf rounds bf16 to nearest even, as torch does."""
    return quantize(array.astype(np.float32, copy=False), qtype)
