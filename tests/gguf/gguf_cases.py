"""GGUF cases: the shared checkpoints llama.cpp's graphs can express, and variants of those they cannot
(a windowed Mistral, SmolLM3's NoPE layer other than every fourth, Gemma 2's query_pre_attn_scalar other
than head_dim), changed to what llama.cpp expresses; plus the serial residual of the two families whose
cases are parallel, and linear rope scaling. ``gguf_case_dir`` (conftest.py) builds them."""
from __future__ import annotations

from checkpoints import CASES, CASES_BY_ID, Case


def _variant(base: str, id: str, **changes) -> Case:
    case = CASES_BY_ID[base]
    return Case(id, case.architecture, {**case.config, **changes})


# case id -> the message refusing its GGUF export
REFUSED = {
    "mistral-window5": "llama graph .* has no sliding-window attention; MistralForCausalLM's sliding_window=5",
    "smollm3-nope": r"smollm3 graph leaves rotary out of every 4th layer \[\], not this model's \[1\]",
    "gemma2-softcap-window6": "gemma2 graph scales attention by 0.25, not this model's 0.204124",
}
VARIANTS = {case.id: case for case in [
    _variant("mistral-window5", "mistral-nowindow", sliding_window=None),
    _variant("smollm3-nope", "smollm3-every4th", num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0]),
    _variant("gemma2-softcap-window6", "gemma2-headscale", query_pre_attn_scalar=16),
    _variant("stablelm-parallel", "stablelm-serial", use_parallel_residual=False),
    _variant("gptneox-parallel", "gptneox-serial", use_parallel_residual=False),
    _variant("llama-gqa3", "llama-linear-rope", rope_scaling=dict(rope_type="linear", factor=4.0)),
]}
GGUF_CASE_IDS = [c.id for c in CASES if c.id not in REFUSED] + list(VARIANTS)
