"""KerasHub on JAX as a bench subject: ``CausalLM.from_preset`` on the Hugging Face directory, then its own
``generate``, which compiles the whole loop (prefill and every decode step) as one XLA program.

Since that loop never returns to Python between tokens, a greedy sampler of KerasHub's kind taps each
step's logits with ``jax.debug.callback``: the host time each token's logits are ready (just before the
argmax) gives the time to first token and the decode time, and the first steps' logits are kept for the
distance. The prompt goes in as token ids with no preprocessor; the sequence is padded to prompt plus
``new_tokens`` with no stop token, so ``generate`` makes exactly ``new_tokens`` tokens.
"""
from __future__ import annotations

import json
import os
import resource
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from linnet.bench.protocol import Job, Subject, TimedGeneration
from linnet.dtypes import DTYPES
from linnet.errors import BackendUnavailable
from linnet.model import open_spec
from linnet.spec import ModelSpec

os.environ["KERAS_BACKEND"] = "jax"  # read once, when keras is first imported: this row is KerasHub on JAX
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # every worker shares one GPU, when there is one
try:  # imported here, so that load time is loading, not importing
    import jax
    import keras_hub
except ModuleNotFoundError as e:  # the row reads "not run: ..." with what is missing
    raise BackendUnavailable(f"KerasHub cannot be imported ({e}); pip install --no-deps keras-hub keras, "
                             "then optree, absl-py and sentencepiece (docs/BENCH.md)") from None


def unsupported(spec: ModelSpec, config: dict) -> str | None:
    """What KerasHub's transformers converters (0.32) would load wrongly or not at all, checked on the tiny
    checkpoints of tests/checkpoints.py. Some load without an error and give garbage, so all are refused here."""
    llama = spec.architecture == "LlamaForCausalLM"
    kind = spec.architecture.removesuffix("ForCausalLM")
    if spec.o_bias or (spec.qkv_bias and spec.architecture != "Qwen2ForCausalLM"):
        return f"KerasHub's {kind} converter drops the attention biases this checkpoint has"
    if spec.architecture != "Qwen3ForCausalLM" and spec.head_dim * spec.num_heads != spec.hidden_size:
        return (f"KerasHub's {kind} model takes head_dim = hidden_size / heads = "
                f"{spec.hidden_size // spec.num_heads}; this checkpoint's is {spec.head_dim}")
    if spec.rope.kind != "default" and not (llama and config.get("rope_scaling")):
        return (f"KerasHub's {kind} converter does not read this checkpoint's {spec.rope.kind} rope scaling "
                "(it reads Llama 3 scaling from transformers 4's `rope_scaling` field only)")
    return None


class KerasHubSubject(Subject):
    def __init__(self, job: Job):
        path = Path(job.model)
        if not path.is_dir():
            raise BackendUnavailable(f"KerasHub loads Hugging Face directories; {job.model} is not one")
        self.spec = open_spec(job.model)
        reason = unsupported(self.spec, json.loads((path / "config.json").read_text()))
        if reason:
            raise BackendUnavailable(reason)
        self.job = job
        self.times: list[float] = []
        self.kept: list[np.ndarray] = []
        self.record = 0
        jax.devices()  # starts the PJRT client, untimed, as for Linnet's XLA rows

    def load(self) -> None:
        lm = keras_hub.models.CausalLM.from_preset(self.job.model, preprocessor=None,
                                                   dtype=DTYPES[self.job.dtype].hf)
        lm.compile(sampler=_TappedGreedy(self._tap))
        self.lm = lm

    def _tap(self, logits: np.ndarray) -> None:
        """Called on the host by the compiled loop as each step's logits are ready."""
        self.times.append(time.perf_counter())
        if len(self.kept) < self.record:
            self.kept.append(np.array(logits, dtype=np.float32))

    def generate(self, prompt: list[int], new_tokens: int, record: int) -> TimedGeneration:
        length = len(prompt) + new_tokens
        ids = np.zeros((1, length), np.int32)
        ids[0, : len(prompt)] = prompt
        mask = np.arange(length)[None] < len(prompt)  # False: a position generate fills
        self.times, self.kept, self.record = [], [], record
        start = time.perf_counter()
        out = self.lm.generate({"token_ids": ids, "padding_mask": mask}, stop_token_ids=None)
        tokens = np.asarray(out["token_ids"])[0, len(prompt):].tolist()
        times = self.times
        logits = np.stack(self.kept) if self.kept else None
        return TimedGeneration(times[0] - start, times[-1] - times[0], tokens, logits)

    def peak_memory(self) -> int:
        device = jax.devices()[0]
        if device.platform != "cpu":  # the process's RSS says nothing of the device's memory
            return (device.memory_stats() or {}).get("peak_bytes_in_use", 0)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def notes(self) -> list[str]:
        p = self.job.protocol
        notes = [f"generate compiled whole by XLA; KV cache of {p.prompt_tokens + p.new_tokens} positions",
                 f"keras-hub {metadata.version('keras-hub')}, keras {metadata.version('keras')}, "
                 f"JAX {jax.__version__} ({jax.devices()[0].platform}; XLA's CPU pool takes no thread count)"]
        eps = getattr(self.lm.backbone, "layer_norm_epsilon", self.spec.rms_norm_eps)
        if eps != self.spec.rms_norm_eps:  # KerasHub 0.32's Llama converter does not read rms_norm_eps
            notes.append(f"KerasHub's model normalises with epsilon {eps:g}, the checkpoint's is "
                         f"{self.spec.rms_norm_eps:g}: part of its distance")
        return notes


class _TappedGreedy(keras_hub.samplers.GreedySampler):
    """KerasHub's greedy sampler, with a host callback on each step's logits (before the softmax)."""

    def __init__(self, tap, **kwargs):
        super().__init__(**kwargs)
        self.tap = tap

    def compute_probabilities(self, logits):
        jax.debug.callback(self.tap, logits[0], ordered=True)  # ordered: the host sees the steps in turn
        return super().compute_probabilities(logits)
