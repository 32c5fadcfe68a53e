"""onnxruntime-genai as a bench subject: its model builder's ONNX model of the Hugging Face directory, run
by its generator, greedy.

The builder (``python -m onnxruntime_genai.models.builder -p fp32 -e cpu``) runs in the untimed
preparation, by whichever process constructs the subject first (the parent's untimed primer); its output
is kept under ``$LINNET_CACHE``, keyed by the checkpoint's files and the onnxruntime-genai version. EOS is
switched off in the model's config, so the generator makes exactly ``new_tokens`` tokens.

The generator runs the model lazily: ``append_tokens`` runs the prompt, each ``generate_next_token`` runs
the step its last token needs (unless ``get_logits`` already did), then picks the argmax. Reading the
logits only moves a step's run earlier, so recording them changes no work.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from linnet import weight_cache
from linnet.bench import machine
from linnet.bench.protocol import Job, Subject, TimedGeneration
from linnet.errors import BackendUnavailable
from linnet.files import atomic_write
from linnet.model import open_spec

try:  # imported here, so that load time is loading, not importing
    import onnxruntime_genai as og
except ModuleNotFoundError as e:
    if e.name != "onnxruntime_genai":
        raise
    raise BackendUnavailable("onnxruntime-genai is not installed "
                             "(pip install --no-deps onnxruntime-genai, beside onnxruntime)") from None
except (ImportError, OSError) as e:  # its library and the installed onnxruntime's do not fit
    raise BackendUnavailable(f"onnxruntime-genai cannot run with this onnxruntime: {e}") from None

PRECISION = "fp32"  # the builder's only float precision for the CPU provider (besides int8 and int4)
VERSION = metadata.version("onnxruntime-genai")


def model_dir(job: Job) -> Path:
    """Where the builder's model of ``job.model`` is kept: the cache, or the run's folder without one."""
    if os.environ.get("LINNET_CACHE") == "off":
        return Path(job.out_dir) / "onnxruntime-genai"
    files = [p for p in Path(job.model).iterdir() if p.is_file()]
    identity = f"{weight_cache.source_identity(files)}\nbuilder {PRECISION} cpu, onnxruntime-genai {VERSION}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:24]
    return weight_cache.cache_root() / f"onnxruntime-genai-{key}"


def build(source: str, out: Path) -> None:
    """The builder, as its documentation runs it. Its output is captured (stdout carries the worker's
    replies), and shown on stderr only if it fails."""
    with tempfile.TemporaryDirectory(prefix="linnet-ortgenai-") as scratch:  # its downloads and temporaries
        done = subprocess.run(
            [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", source, "-o", str(out),
             "-p", PRECISION, "-e", "cpu", "-c", scratch],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout)
        last = done.stdout.strip().splitlines()[-1:] or [f"status {done.returncode}"]
        raise BackendUnavailable(f"onnxruntime-genai's model builder failed: {last[0]}")


class OrtGenAISubject(Subject):
    def __init__(self, job: Job):
        if not Path(job.model).is_dir():
            raise BackendUnavailable(f"onnxruntime-genai's builder reads Hugging Face directories; "
                                     f"{job.model} is not one")
        if job.dtype != "f32":
            raise BackendUnavailable(f"onnxruntime-genai's builder makes {PRECISION} models for the CPU "
                                     f"(or int8, int4), not {job.dtype}")
        spec = open_spec(job.model)
        if spec.head_dim % 8:  # the builder's model would load, then fail on the prompt
            raise BackendUnavailable(f"ONNX Runtime's GroupQueryAttention on the CPU needs a head size that is "
                                     f"a multiple of 8; this model's is {spec.head_dim}")
        self.job = job
        self.path = model_dir(job)
        if not (self.path / "genai_config.json").exists():
            atomic_write(self.path, lambda tmp: build(job.model, tmp))
        self.threads = int(os.environ.get("OMP_NUM_THREADS") or machine.cores())  # as the parent set it

    def load(self) -> None:
        config = og.Config(str(self.path))
        options = {"intra_op_num_threads": self.threads, "inter_op_num_threads": 1}
        # No EOS: every row makes exactly new_tokens tokens (and no EOS logit is touched).
        config.overlay(json.dumps({"model": {"eos_token_id": [], "decoder": {"session_options": options}}}))
        self.model = og.Model(config)

    def generate(self, prompt: list[int], new_tokens: int, record: int) -> TimedGeneration:
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
        generator = og.Generator(self.model, params)  # made before the clock, as Linnet's cache is reset
        ids = np.array([prompt], dtype=np.int32)
        kept: list[np.ndarray] = []
        tokens: list[int] = []

        def keep() -> None:
            if len(kept) < record:
                kept.append(np.array(generator.get_logits(), dtype=np.float32).reshape(-1))

        start = time.perf_counter()
        generator.append_tokens(ids)
        keep()
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
        first = time.perf_counter()
        while len(tokens) < new_tokens:
            keep()
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        end = time.perf_counter()
        return TimedGeneration(first - start, end - first, tokens, np.stack(kept) if kept else None)

    def peak_memory(self) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def notes(self) -> list[str]:
        p = self.job.protocol
        return [f"model builder {PRECISION}, CPU provider; KV cache of {p.prompt_tokens + p.new_tokens} positions "
                "shared by past and present",
                f"{self.threads} intra-op thread{'s' * (self.threads != 1)}",
                f"onnxruntime-genai {VERSION}, onnxruntime {metadata.version('onnxruntime')}"]
