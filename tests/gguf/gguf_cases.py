"""GGUF cases: the shared checkpoints llama.cpp's graphs can express, and variants of those they cannot (a
windowed Mistral, SmolLM3's NoPE layer other than every fourth, Gemma 2's query_pre_attn_scalar other than
head_dim, Gemma 3's layers other than every sixth global, local rope base other than 10000 and
query_pre_attn_scalar other than head_dim), changed to what llama.cpp expresses; plus the serial residual of
the two families whose cases are parallel, and rope scaling: linear, YaRN (Llama's interleaved rope; Qwen2's
halves, with an attention factor of its own) and Phi-3's LongRoPE. llama.cpp applies one set of LongRoPE
factors to a whole context (the long ones when its context size exceeds the original), Linnet's per position,
so the llama.cpp test sees the short factors (an original context of 256, past llama.cpp's context of 64,
padded to at most 256) and, in a variant whose two sets are the same, the long ones with their attention
factor. ``gguf_case_dir`` (conftest.py) builds them.

Mixtures of experts: Mixtral's and Granite-MoE's cases as they are; Qwen2-MoE and Qwen3-MoE without dense
layers, OLMoE with as many kv heads as heads, gpt-oss with llama.cpp's SwiGLU limit and YaRN rounded out to
whole dims (llama.cpp's graphs of them fix those)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from checkpoints import CASES, CASES_BY_ID, MOE_CASES, Case
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize


def _variant(base: str, id: str, **changes) -> Case:
    case = CASES_BY_ID[base]
    return Case(id, case.architecture, {**case.config, **changes})


LONG_FACTORS = [2.0, 5.0, 9.0, 31.0]  # LongRoPE's, for Phi-3's 8 rotary dims
# case id -> the message refusing its GGUF export
REFUSED = {
    "mistral-window5": "llama graph .* has no sliding-window attention; MistralForCausalLM's sliding_window=5",
    "smollm3-nope": r"smollm3 graph leaves rotary out of every 4th layer \[\], not this model's \[1\]",
    "gemma2-softcap-window6": "gemma2 graph scales attention by 0.25, not this model's 0.204124",
    "gemma3-local-rope": "gemma3 graph scales attention by 0.25, not this model's 0.0625",
    "qwen2moe-shared-dense": r"qwen2moe graph has no dense layers among the sparse ones; .* layers \[1\] are dense",
    "qwen3moe-step2": r"qwen3moe graph has no dense layers among the sparse ones; .* layers \[0, 2\] are dense",
    "olmoe-top3of5": "olmoe graph sizes the k norm embedding_length wide, for as many kv heads as heads",
    "gptoss-sinks-window5": "YaRN rounds its correction range out to whole dims; this model's rope scaling has "
                            "truncate=false",
}
MOE_VARIANTS = [
    _variant("qwen2moe-shared-dense", "qwen2moe-shared", mlp_only_layers=[]),
    _variant("qwen3moe-step2", "qwen3moe-sparse", decoder_sparse_step=1),
    _variant("olmoe-top3of5", "olmoe-mha", num_key_value_heads=4),
    _variant("gptoss-sinks-window5", "gptoss-limit7", swiglu_limit=7.0, rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=8.0, original_max_position_embeddings=32)),
]
VARIANTS = {case.id: case for case in [
    _variant("mistral-window5", "mistral-nowindow", sliding_window=None),
    _variant("smollm3-nope", "smollm3-every4th", num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0]),
    _variant("gemma2-softcap-window6", "gemma2-headscale", query_pre_attn_scalar=16),
    _variant("gemma3-local-rope", "gemma3-local10k", num_hidden_layers=6, layer_types=None,
             rope_local_base_freq=10000.0, query_pre_attn_scalar=16),
    _variant("stablelm-parallel", "stablelm-serial", use_parallel_residual=False),
    _variant("gptneox-parallel", "gptneox-serial", use_parallel_residual=False),
    _variant("llama-gqa3", "llama-linear-rope", rope_scaling=dict(rope_type="linear", factor=4.0)),
    _variant("llama-gqa3", "llama-yarn-rope", rope_theta=50.0,
             rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
    _variant("qwen2-tied", "qwen2-yarn-attention", rope_theta=100.0, rope_scaling=dict(
        rope_type="yarn", factor=2.0, original_max_position_embeddings=64, attention_factor=1.25)),
    _variant("phi3-partial", "phi3-longrope-short", max_position_embeddings=1024, original_max_position_embeddings=256,
             rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.5, 3.0, 7.0], long_factor=LONG_FACTORS)),
    _variant("phi3-partial", "phi3-longrope-long", original_max_position_embeddings=8,
             rope_scaling=dict(rope_type="longrope", short_factor=LONG_FACTORS, long_factor=LONG_FACTORS)),
    *MOE_VARIANTS,
]}
GGUF_CASE_IDS = [c.id for c in CASES + MOE_CASES if c.id not in REFUSED] + list(VARIANTS)
MOE_GGUF_CASE_IDS = [c.id for c in MOE_CASES if c.id not in REFUSED] + [c.id for c in MOE_VARIANTS]

# Experts whose rows are whole blocks of 32 (hidden 64, each expert 64 wide), for quantised expert tensors:
# renormalised SwiGLU experts, and gpt-oss's biased, clamped ones
BLOCKS = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
EXPERT_BLOCK_CASES = {case.id: case for case in [
    Case("mixtral-blocks", "MixtralForCausalLM", BLOCKS),
    Case("gptoss-blocks", "GptOssForCausalLM", dict(BLOCKS, sliding_window=5, rope_parameters=dict(
        rope_type="yarn", rope_theta=150000.0, factor=8.0, original_max_position_embeddings=32))),
]}
BUILT = {**VARIANTS, **EXPERT_BLOCK_CASES}  # the cases ``gguf_case_dir`` builds here


def rewritten(path: Path, out: Path, change: Callable[[str, np.ndarray], tuple[np.ndarray, GGMLQuantizationType] | None]
              ) -> Path:
    """A copy of the GGUF file ``path``, its metadata as it was, with each tensor that ``change`` (given its name
    and values) returns new values and a type for stored so."""
    reader = GGUFReader(path)
    writer = GGUFWriter(out, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            array = field.types[0] == GGUFValueType.ARRAY
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if array else None)
    for tensor in reader.tensors:
        changed = change(tensor.name, dequantize(tensor.data, tensor.tensor_type))
        values, qtype = (tensor.data, tensor.tensor_type) if changed is None else (quantize(*changed), changed[1])
        writer.add_tensor(tensor.name, values, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
