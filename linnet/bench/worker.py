"""One bench subject in its own process: ``python -m linnet.bench.worker JOB SUBJECT [--load-only]``.

A line protocol with the parent, so that the parent decides when each generation runs (taking turns
with the other subjects or not). The worker loads the subject and prints one JSON line: its threads,
OMP policy and load time, or ``not_run``. Then, for each ``run`` line it reads, it runs one generation
and prints its samples (the first also records its logits and pays any compilation); on ``done`` or
at the end of its input it prints the peak memory and notes, and exits. ``--load-only``: load, reply,
exit.
Threads and OMP settings come from the environment the parent gave this process.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from linnet import openmp
from linnet.backends.registry import backend_ids, get_backend
from linnet.bench.protocol import CHECK_STEPS, PEERS, Job, Subject
from linnet.errors import BackendUnavailable, LinnetError


def open_subject(name: str, job: Job) -> Subject:
    """Any of the registry's backends, or a peer."""
    if name in backend_ids():
        from linnet.bench.backends import LinnetSubject

        return LinnetSubject(get_backend(name), job)
    if name == "llama.cpp":
        from linnet.bench.peers_llamacpp import LlamaCppSubject

        return LlamaCppSubject(job)
    if name == "keras-hub":
        from linnet.bench.peers_keras import KerasHubSubject

        return KerasHubSubject(job)
    if name == "onnxruntime-genai":
        from linnet.bench.peers_ortgenai import OrtGenAISubject

        return OrtGenAISubject(job)
    if name in PEERS:
        try:
            from linnet.bench.peers import TransformersSubject
        except ModuleNotFoundError as e:
            if e.name != "transformers":
                raise
            raise BackendUnavailable("transformers is not installed (pip install transformers)") from None
        return TransformersSubject(name == "transformers:compiled", job)
    raise LinnetError(f"unknown bench subject {name!r}; choose from {', '.join([*backend_ids(), *PEERS])}")


def reply(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


def failure(e: Exception) -> dict[str, str]:
    """A row "not run" with the reason: never an estimate. Unexpected errors keep their traceback."""
    if isinstance(e, BackendUnavailable):
        return {"not_run": str(e)}
    traceback.print_exc()
    return {"not_run": f"failed: {type(e).__name__}: {e}"}


def generation(subject: Subject, name: str, job: Job, first: bool) -> dict[str, Any]:
    p = job.protocol
    started = time.time()  # wall clock: when each subject's turns ran, for the parent's record
    g = subject.generate(job.prompt, p.new_tokens, record=CHECK_STEPS + 1 if first else 0)
    if len(g.tokens) != p.new_tokens:
        raise LinnetError(f"{name} generated {len(g.tokens)} tokens, not the {p.new_tokens} asked for")
    sample: dict[str, Any] = {"started": started, "ttft_s": g.ttft_s, "decode_tok_s": (p.new_tokens - 1) / g.decode_s}
    if first:
        assert g.logits is not None  # recorded on the first generation
        np.save(job.logits_path(name), g.logits)
        sample.update(first_generation_s=g.ttft_s + g.decode_s, tokens=g.tokens[: len(g.logits)])
    return sample


def serve(name: str, job: Job, commands: IO[str], load_only: bool = False) -> None:
    header = {
        "threads": torch.get_num_threads(),
        "openmp": openmp.describe(os.environ),
        "accelerator": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        subject = open_subject(name, job)
        start = time.perf_counter()
        subject.load()
        reply({**header, "load_s": time.perf_counter() - start})
    except Exception as e:
        reply({**header, **failure(e)})
        return
    if load_only:
        return
    runs = 0
    for line in commands:
        if line.strip() != "run":
            break
        try:
            reply(generation(subject, name, job, first=runs == 0))
        except Exception as e:
            reply(failure(e))
            return
        runs += 1
    runner = getattr(subject, "runner", None)  # a Linnet backend's: the dtype its KV cache is kept in
    reply({"peak_memory": subject.peak_memory(), "notes": subject.notes(),
           "kv_cache_dtype": runner.cache_dtype if runner is not None else None})


def main(argv: list[str]) -> int:
    job_path, name, *flags = argv
    try:
        job = Job.load(Path(job_path))
    except Exception as e:
        reply(failure(e))
        return 0
    serve(name, job, sys.stdin, load_only="--load-only" in flags)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
