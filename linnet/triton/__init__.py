"""A Triton Inference Server model repository that serves a model through ``linnet.serve``.

The repository holds one model, a Python-backend model (``model.py``, copied from this package's
``model.py``) that hosts the same continuous-batching ``Engine`` as ``linnet serve``. Triton's own batching
is off and one instance runs: the engine batches the requests in its cache rows itself. The model is
decoupled: each request streams one response per generated piece, the last with the final flag.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from linnet.serve.engine import STEP_PROMPT_TOKENS

TEMPLATE = Path(__file__).with_name("model.py")

# (name, Triton type, dims): every input but the prompt is optional, with the defaults model.py gives.
INPUTS = (
    ("text_input", "TYPE_STRING", "[ 1 ]"),  # plain text, tokenized as `linnet serve` tokenizes a prompt
    ("prompt_ids", "TYPE_INT64", "[ -1 ]"),  # or the token ids themselves
    ("max_tokens", "TYPE_INT32", "[ 1 ]"),
    ("temperature", "TYPE_FP32", "[ 1 ]"),
    ("top_p", "TYPE_FP32", "[ 1 ]"),
    ("top_k", "TYPE_INT32", "[ 1 ]"),
    ("seed", "TYPE_INT64", "[ 1 ]"),
    ("stop", "TYPE_STRING", "[ -1 ]"),
    ("stop_token_ids", "TYPE_INT64", "[ -1 ]"),
    ("ignore_eos", "TYPE_BOOL", "[ 1 ]"),
    ("stream", "TYPE_BOOL", "[ 1 ]"),
)
OUTPUTS = (
    ("text_output", "TYPE_STRING", "[ 1 ]"),
    ("token_ids", "TYPE_INT64", "[ -1 ]"),
    ("finish_reason", "TYPE_STRING", "[ 1 ]"),  # empty until the last response
    ("prompt_tokens", "TYPE_INT32", "[ 1 ]"),
    ("completion_tokens", "TYPE_INT32", "[ 1 ]"),
)


@dataclass(frozen=True)
class Settings:
    """What model.py reads from the repository's parameters to build its runner and engine."""

    model: str  # a model directory or .gguf file (absolute), or a registry name
    backend: str = "torch:eager"
    dtype: str = "f32"
    rows: int = 64
    positions: int = 640
    max_queue: int = 256
    threads: int = 0  # 0: the backend's choice
    prefill_tokens: int = STEP_PROMPT_TOKENS  # prompt tokens a step reads over all rows


def config_pbtxt(name: str, settings: Settings) -> str:
    def tensors(specs: tuple[tuple[str, str, str], ...], optional: bool) -> str:
        extra = " optional: true" if optional else ""
        return ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d}{extra} }}' for n, t, d in specs)

    def quoted(value: object) -> str:  # JSON's escapes are valid in protobuf text format
        return json.dumps(str(value), ensure_ascii=False)

    parameters = "\n".join(f'parameters {{ key: "{key}" value: {{ string_value: {quoted(value)} }} }}'
                           for key, value in vars(settings).items())
    return f"""\
# Written by `linnet triton`. A Python-backend model hosting linnet.serve's engine: one instance, whose
# engine batches requests in its {settings.rows} cache rows itself; decoupled, so each request streams a
# response per generated piece. Give text_input (text) or prompt_ids (token ids).
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
{tensors(INPUTS, True)}
]
output [
{tensors(OUTPUTS, False)}
]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{parameters}
"""


def write_repository(out: Path, name: str, settings: Settings) -> list[str]:
    """Write the repository's files into the (new) directory ``out``; returns their paths within it."""
    files = {f"{name}/config.pbtxt": config_pbtxt(name, settings), f"{name}/1/model.py": TEMPLATE.read_text()}
    for path, text in files.items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text)
    return list(files)
