"""llama.cpp (through llama-cpp-python) as a bench subject, on the same GGUF file as Linnet.

A GGUF model runs as it is, in its own weight types. A Hugging Face directory is first written as GGUF
in the run's dtype (``linnet.gguf.export``, as ``linnet export gguf`` does) in the job's folder: untimed
preparation, done by whichever process constructs the subject first (the parent's untimed primer).
Greedy decoding is the argmax of the last position's logits, read from llama.cpp's own buffer.
"""
from __future__ import annotations

import os
import resource
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from linnet.bench import machine
from linnet.bench.bandwidth import gguf_for, llama_cpp_reads
from linnet.bench.protocol import Job, Subject, TimedGeneration
from linnet.errors import BackendUnavailable
from linnet.model import open_spec

FLASH_ATTENTION = False  # llama-cpp-python's default; every row states it
GGML_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids, for the KV cache


class LlamaCppSubject(Subject):
    def __init__(self, job: Job):
        try:
            import llama_cpp
        except ModuleNotFoundError as e:
            if e.name != "llama_cpp":
                raise
            raise BackendUnavailable("llama-cpp-python is not installed (pip install llama-cpp-python)") from None
        self.llama_cpp, self.job = llama_cpp, job
        self.path = gguf_for(job)
        if not self.path.exists():
            self._export()
        reads = llama_cpp_reads(job, open_spec(str(self.path)))
        self.weight_type, self.kv_type = reads.weight_type, reads.kv_type
        self.threads = int(os.environ.get("OMP_NUM_THREADS") or machine.cores())  # as the parent set it

    def _export(self) -> None:
        from linnet.gguf.export import TYPES, export_gguf
        from linnet.model import open_model

        if self.job.dtype not in TYPES:
            raise BackendUnavailable(f"Linnet writes GGUF in {', '.join(TYPES)}, not {self.job.dtype}")
        export_gguf(open_model(self.job.model), self.path, self.job.dtype)

    def load(self) -> None:
        p, kv = self.job.protocol, GGML_TYPES[self.kv_type]
        self.llm = self.llama_cpp.Llama(
            str(self.path), n_ctx=p.prompt_tokens + p.new_tokens, n_threads=self.threads,
            n_threads_batch=self.threads, flash_attn=FLASH_ATTENTION, type_k=kv, type_v=kv, verbose=False,
        )
        self.vocab = self.llm.n_vocab()

    def generate(self, prompt: list[int], new_tokens: int, record: int) -> TimedGeneration:
        llm = self.llm
        kept: list[np.ndarray] = []

        def pick() -> int:
            logits = np.ctypeslib.as_array(self.llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(self.vocab,))
            if len(kept) < record:
                kept.append(logits.copy())
            return int(logits.argmax())

        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        tokens = [pick()]
        first = time.perf_counter()
        while len(tokens) < new_tokens:
            llm.eval([tokens[-1]])
            tokens.append(pick())
        end = time.perf_counter()
        return TimedGeneration(first - start, end - first, tokens, np.stack(kept) if kept else None)

    def peak_memory(self) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def notes(self) -> list[str]:
        origin = "the GGUF file as it is" if self.path == Path(self.job.model) else \
            f"exported from the Hugging Face directory in {self.job.dtype}"
        return [f"weights {self.weight_type} ({origin})", f"KV cache {self.kv_type}",
                f"flash attention {'on' if FLASH_ATTENTION else 'off'}",
                f"llama-cpp-python {metadata.version('llama_cpp_python')}"]
