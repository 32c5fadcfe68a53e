"""One bench subject in its own process: ``python -m linnet.bench.worker JOB SUBJECT [--load-only]``.

Loads the subject, runs the warm-ups and the timed runs (the first generation records its logits and
pays any compilation), and prints one JSON line: the raw samples, or ``not_run``.
Threads and OMP settings come from the environment the parent gave this process.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from linnet.bench.protocol import CHECK_STEPS, LINNET_BACKENDS, PEERS, Job, Subject
from linnet.errors import BackendUnavailable, LinnetError


def open_subject(name: str, job: Job) -> Subject:
    if name in LINNET_BACKENDS:
        from linnet.bench.backends import LinnetSubject

        return LinnetSubject(name, job)
    if name in PEERS:
        try:
            from linnet.bench.peers import TransformersSubject
        except ModuleNotFoundError as e:
            if e.name != "transformers":
                raise
            raise BackendUnavailable("transformers is not installed (pip install transformers)") from None
        return TransformersSubject(name == "transformers:compiled", job)
    raise LinnetError(f"unknown bench subject {name!r}; choose from {', '.join(LINNET_BACKENDS + PEERS)}")


def measure(name: str, job: Job, load_only: bool = False) -> dict[str, Any]:
    p = job.protocol
    subject = open_subject(name, job)
    start = time.perf_counter()
    subject.load()
    report: dict[str, Any] = {"load_s": time.perf_counter() - start, "ttft_s": [], "decode_tok_s": []}
    if load_only:
        return report
    for i in range(p.warmups + p.runs):
        g = subject.generate(job.prompt, p.new_tokens, record=CHECK_STEPS + 1 if i == 0 else 0)
        if len(g.tokens) != p.new_tokens:
            raise LinnetError(f"{name} generated {len(g.tokens)} tokens, not the {p.new_tokens} asked for")
        if i == 0:
            np.save(job.logits_path(name), g.logits)
            report.update(first_generation_s=g.ttft_s + g.decode_s, tokens=g.tokens[: len(g.logits)])
        if i >= p.warmups:
            report["ttft_s"].append(g.ttft_s)
            report["decode_tok_s"].append((p.new_tokens - 1) / g.decode_s)
    report.update(peak_memory=subject.peak_memory(), notes=subject.notes())
    return report


def main(argv: list[str]) -> int:
    job_path, name, *flags = argv
    report: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "accelerator": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        report.update(measure(name, Job.load(Path(job_path)), load_only="--load-only" in flags))
    except BackendUnavailable as e:
        report["not_run"] = str(e)
    except Exception as e:  # reported, not hidden: the row says "failed" and the command exits 1
        traceback.print_exc()
        report["not_run"] = f"failed: {type(e).__name__}: {e}"
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
