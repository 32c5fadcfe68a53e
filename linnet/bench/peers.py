"""transformers as a bench subject: ``generate``, eager (the reference) or compiled with its static cache.

Timing comes from a streamer (``generate`` hands it the prompt, then each token as it is chosen); the
reference logits come from a logits processor that sees the raw scores and changes nothing.
"""
from __future__ import annotations

import importlib
import resource
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM  # resolved here, so load time is loading, not importing

from linnet.bench.protocol import Job, Subject, TimedGeneration
from linnet.dtypes import DTYPES
from linnet.errors import BackendUnavailable


class TransformersSubject(Subject):
    def __init__(self, compiled: bool, job: Job):
        if not Path(job.model).is_dir():
            raise BackendUnavailable(f"transformers loads Hugging Face directories; {job.model} is not one")
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.job = job
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.options: dict = {}
        if compiled:
            importlib.import_module("torch._inductor.config")  # untimed, as for Linnet's compiled modes
            # generate compiles the decode step once the cache is static; on CPU only when told to.
            config = transformers.CompileConfig()
            config._compile_all_devices = self.device.type == "cpu"  # type: ignore[assignment]  # typed None there
            self.options = dict(cache_implementation="static", compile_config=config)

    def load(self) -> None:
        dtype = getattr(torch, DTYPES[self.job.dtype].hf)  # torch names its dtypes as config.json does
        model = AutoModelForCausalLM.from_pretrained(self.job.model, dtype=dtype)
        # transformers wraps ``to`` with functools.wraps, whose stub loses the bound ``self``
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        # Plain greedy decoding: a checkpoint's own defaults (sampling, repetition penalty, EOS) are dropped.
        self.model.generation_config = transformers.GenerationConfig(do_sample=False)

    def generate(self, prompt: list[int], new_tokens: int, record: int) -> TimedGeneration:
        clock, recorder = _Clock(), _Recorder(record)
        ids = torch.tensor([prompt], device=self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids, max_new_tokens=new_tokens, eos_token_id=None, streamer=clock,  # no EOS: every token
                logits_processor=transformers.LogitsProcessorList([recorder]), **self.options,
            )
        tokens = out[0, len(prompt):].tolist()
        times = clock.times
        logits = np.stack(recorder.kept) if recorder.kept else None
        return TimedGeneration(times[0] - start, times[-1] - times[0], tokens, logits)

    def peak_memory(self) -> int:
        if self.device.type == "cuda":  # as Linnet's runner reports it, so the two compare
            free, total = torch.cuda.mem_get_info(self.device)
            return max(torch.cuda.max_memory_reserved(self.device), total - free)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Clock:
    """A streamer that keeps the time each new token reaches the host (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


class _Recorder:
    """A logits processor that copies the first ``count`` steps' raw scores and returns them unchanged."""

    def __init__(self, count: int):
        self.count = count
        self.kept: list[np.ndarray] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if len(self.kept) < self.count:
            self.kept.append(scores[0].float().cpu().numpy().copy())
        return scores
