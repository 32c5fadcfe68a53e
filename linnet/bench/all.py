"""``linnet bench MODEL --all -o DIR``: every row this machine can run, into one results file that grows row by row.

The rows are the peers (transformers first: the reference), every benched Linnet backend in each dtype it
declares (``torch:inductor@bf16``), the serving rows, then vLLM on one request (``linnet.bench.vllm_rows``:
on the checkpoint, and on Linnet's Hugging Face export of it). They run one after another, each subject in
worker processes of its own (an untimed primer, then the timed one, as ``linnet bench --sequential``), all
on one checkpoint with one seeded prompt. A subject still running after the time limit is killed with what
it started and recorded "not run: time limit of N s". A GGUF model is first exported as a Hugging Face
directory (f32), which every subject then loads: the peers need one, and llama.cpp runs Linnet's GGUF
export of it, so every row reads the same weights.

After each row the results file is written whole (validated), so a killed run loses at most the row it was
in: ``--resume`` keeps the rows the file holds and runs the others. What a resumed run needs of earlier
rows (the exported checkpoint, the reference's logits and tokens) stays in a hidden work folder beside the
file until the last row is done.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from linnet.backends.registry import backends
from linnet.bench import arithmetic, bandwidth, machine, vllm_rows
from linnet.bench.harness import (
    distance_from_reference,
    importable_here,
    make_row,
    prime,
    run_turns,
    worker_environment,
)
from linnet.bench.protocol import PEERS, REFERENCE, Job, random_prompt
from linnet.errors import LinnetError, ResultsError
from linnet.model import open_model, open_spec, resolve
from linnet.registry.schema import Protocol, parse
from linnet.results import SERVING_GROUP, Against, Machine, Metric, Results, Row, load_results, save_results

# Named protocols. ``seed`` is the seed pages' own; ``cpu-small`` fits every row of a small model into
# minutes on a few cores; ``gpu-small`` keeps the seed's lengths with fewer runs, so that a lent GPU
# machine's ten minutes hold every row of a 0.5B model (scripts/gpu_check.sh, stage ``all``).
PROFILES = {
    "seed": Protocol(prompt_tokens=512, new_tokens=128, batch=1, runs=10, warmups=3),
    "cpu-small": Protocol(prompt_tokens=128, new_tokens=32, batch=1, runs=3, warmups=1),
    "gpu-small": Protocol(prompt_tokens=512, new_tokens=128, batch=1, runs=3, warmups=1),
}
TIME_LIMIT_S = 1800  # per row: a compiled backend's first compile on a slow CPU takes minutes, not half an hour


# Each bench profile's serving profile (linnet.bench.serving), where this Linnet has the serving bench.
SERVING_PROFILES = {"seed": "seed", "cpu-small": "cpu-decode", "gpu-small": "seed"}


@dataclass(frozen=True)
class Planned:
    """A row to run: its id, the subject its worker runs (a server spec for a serving row), and in which dtype."""

    id: str
    subject: str
    dtype: str
    serving: bool = False


@dataclass(frozen=True)
class AllSettings:
    model: str  # a path or registry name
    out_dir: Path
    profile: str = "seed"
    dtype: str = "f32"  # the peers' dtype, and the reference's
    threads: int | None = None
    time_limit_s: float = TIME_LIMIT_S
    resume: bool = False
    force: bool = False
    only: tuple[str, ...] = ()  # row ids: run these alone, again if the file holds them (with resume)


def plan(dtype: str) -> list[Planned]:
    """The peers in ``dtype`` (the reference first), each benched backend in each dtype it runs, then the
    serving rows in ``dtype``: linnet serve on each benched backend, transformers serve and vLLM."""
    peers = sorted(PEERS, key=lambda s: s != REFERENCE)
    benched = [b for b in backends() if b.package.benched]
    linnet = [Planned(f"{b.id}@{d}", b.id, d) for b in benched for d in b.dtypes]
    rows = [Planned(p, p, dtype) for p in peers] + linnet
    if _serving() is None:
        return rows
    from linnet.bench.serving_servers import server_ids

    specs = [f"linnet:{b.id}" for b in benched] + ["transformers", "vllm"]
    return rows + [Planned(server_ids(s)[0], s, dtype, serving=True) for s in specs]


def _serving() -> Any:
    """linnet.bench.serving, or None in a Linnet without the serving bench."""
    if importlib.util.find_spec("linnet.bench.serving") is None:
        return None
    from linnet.bench import serving

    return serving


def protocol_of(profile: str) -> Protocol:
    serving = _serving()
    protocol = PROFILES[profile]
    if serving is None:
        return protocol
    return replace(protocol, serving=serving.PROFILES[SERVING_PROFILES[profile]].serving())


def model_id(model: str) -> str:
    """What the results file names the model: a registry name as given, else the file or folder's name."""
    path = Path(model).expanduser()
    return path.name.removesuffix(".gguf") if path.exists() else model.lower()


def machine_slug() -> str:
    cpu = re.sub(r"\((r|tm)\)|\bcpu\b|@.*", "", (machine.cpu_model() or "cpu").lower())
    return f"{re.sub(r'[^a-z0-9]+', '-', cpu).strip('-')}-{machine.cores()}c"


def results_path(settings: AllSettings) -> Path:
    """One file per model, machine and profile."""
    return settings.out_dir / f"{model_id(settings.model)}.{machine_slug()}.{settings.profile}.json"


def run_all(settings: AllSettings, log: Any = sys.stderr) -> tuple[Results, Path]:
    protocol = protocol_of(settings.profile)
    planned = plan(settings.dtype) + [Planned(i, i, settings.dtype) for i in vllm_rows.ROWS]
    unknown = sorted(set(settings.only) - {p.id for p in planned})
    if unknown:
        raise LinnetError(f"no row {', '.join(map(repr, unknown))} in this run; its rows: "
                          f"{', '.join(p.id for p in planned)}")
    out = results_path(settings)
    work = out.with_name(f".{out.stem}.work")
    done = _previous(settings, out, protocol)
    if not settings.resume and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    threads = settings.threads or machine.cores()
    env = worker_environment(threads, "passive")
    checkpoint, exported = _checkpoint(settings.model, work, log)
    spec = open_spec(str(checkpoint))
    prompt = random_prompt(spec.vocab_size, protocol.prompt_tokens)
    jobs = {}
    for dtype in dict.fromkeys(p.dtype for p in planned if not p.serving):
        (work / dtype).mkdir(exist_ok=True)
        jobs[dtype] = Job(str(checkpoint), dtype, protocol, prompt, str(work / dtype))
        jobs[dtype].save(work / f"job-{dtype}.json")
    if done is None:
        print("linnet bench --all: measuring the read bandwidth ...", file=log, flush=True)
        read_gb_s = bandwidth.measure_apart(importable_here(env), log)
        gflop_s = arithmetic.measure_apart(importable_here(env), settings.dtype, log) if any(
            p.serving for p in planned) else None
        done = Results(
            model=model_id(settings.model),
            timestamp=datetime.now(UTC).isoformat(timespec="seconds"),
            machine=Machine(accelerator=None, cpu=machine.cpu(),
                            memory_gib=machine.memory_gib(), threads=threads,
                            load_average=[round(x, 2) for x in os.getloadavg()],
                            read_gb_s=Metric(statistics.median(read_gb_s), read_gb_s),
                            matmul_gflop_s=Metric(statistics.median(gflop_s), gflop_s) if gflop_s else None),
            versions=machine.versions(), protocol=protocol, rows=[], profile=settings.profile)
    results = done
    rows = {r.id: r for r in results.rows}
    # Rows asked for by name run again, even where the file holds them (a "not run" row, say).
    todo = [p for p in planned if p.id in settings.only] if settings.only else \
        [p for p in planned if p.id not in rows]
    why = "the rows asked for" if settings.only else f"{len(planned) - len(todo)} done already"
    print(f"linnet bench --all: {len(todo)} of {len(planned)} rows to run ({why}), "
          f"at most {settings.time_limit_s:g} s each; writing {out}", file=log, flush=True)
    for i, p in enumerate(todo, 1):
        print(f"linnet bench --all: [{i}/{len(todo)}] {p.id} ...", file=log, flush=True)
        started = time.monotonic()
        if p.serving:
            row = serving_row(p, str(checkpoint), settings.profile, threads, settings.time_limit_s, log)
            if results.machine.matmul_gflop_s:
                arithmetic.add_notes([row], spec, results.machine.matmul_gflop_s.value, p.dtype)
        elif p.id in vllm_rows.ROWS:
            row = run_vllm_row(p, checkpoint, exported, work, jobs, spec, results.machine, threads,
                               settings.time_limit_s, log)
        else:
            report = run_row(p, work / f"job-{p.dtype}.json", env, protocol, settings.time_limit_s, log)
            row = _row(p, report, jobs, work, spec, results.machine, exported)
            if report.get("accelerator") and results.machine.accelerator is None:
                results = replace(results, machine=replace(results.machine, accelerator=report["accelerator"]))
        rows[p.id] = row
        results = _save(results, planned, rows, out)
        metric = "serve_tok_s" if p.serving else "decode_tok_s"
        outcome = f"not run: {row.not_run}" if row.not_run else f"{row.value(metric):.1f} tok/s"
        print(f"linnet bench --all: [{i}/{len(todo)}] {p.id}: {outcome} ({time.monotonic() - started:.0f} s)",
              file=log, flush=True)
    results = _save(results, planned, rows, out)
    if all(p.id in rows for p in planned):
        shutil.rmtree(work)
    return results, out


def _previous(settings: AllSettings, out: Path, protocol: Protocol) -> Results | None:
    """The results to continue (``--resume``), or None to start afresh."""
    if not out.exists():
        return None
    if not settings.resume:
        if settings.force:
            return None
        raise LinnetError(f"{out} already exists; pass --resume to run the rows it lacks, "
                          "or --force to start again")
    results = load_results(out)
    if results.protocol != protocol:
        raise LinnetError(f"{out} was measured under another protocol ({results.protocol}); "
                          f"it cannot be resumed with --profile {settings.profile}")
    return results


def _checkpoint(model: str, work: Path, log: Any) -> tuple[Path, str | None]:
    """The Hugging Face directory every subject loads, and what was exported to make it, if anything."""
    path = resolve(model)
    if path.is_dir():
        return path, None
    hf = work / "hf"
    if not hf.exists():
        from linnet.hf.export import export_hf

        print(f"linnet bench --all: exporting {path.name} as a Hugging Face directory (f32) ...", file=log, flush=True)
        export_hf(open_model(str(path)), hf, "f32")
    return hf, f"on Linnet's Hugging Face export (f32) of {path.name}"


def run_row(p: Planned, job: Path, env: dict[str, str], protocol: Protocol, time_limit_s: float, log: Any
            ) -> dict[str, Any]:
    """One subject: an untimed load (caches, exports, compiles), then its timed runs; within the limit."""
    deadline = time.monotonic() + time_limit_s
    primed = prime(job, p.subject, env, time_limit_s)
    if "not_run" in primed:
        return primed
    return run_turns(job, [p.subject], env, protocol, log, time_limit=deadline - time.monotonic())[p.subject]


def _row(p: Planned, report: dict[str, Any], jobs: dict[str, Job], work: Path, spec: Any, on: Machine,
         exported: str | None, make: Any = make_row) -> Row:
    """``make``: the report to a row (``make_row(subject, report, distance, interleaved)``)."""
    reference = work / "reference.json"
    distance = None
    if "not_run" not in report:
        if p.id == REFERENCE:
            reference.write_text(json.dumps({"tokens": report["tokens"], "dtype": p.dtype}))
        elif reference.exists():
            ref = json.loads(reference.read_text())
            distance = distance_from_reference(jobs[p.dtype], p.subject, {p.subject: report, REFERENCE: ref},
                                               reference=jobs[ref["dtype"]])
    row = make(p.subject, report, distance, interleaved=False)
    if p.id != p.subject:
        row.id, row.name = p.id, f"{row.name} {p.dtype}"
    elif row.not_run is None:
        row.notes.insert(0, p.dtype)
    if row.not_run is None:
        # vLLM, as the other peers, keeps its KV cache in the weights' dtype
        reads = bandwidth.subject_reads(REFERENCE if p.id in vllm_rows.ROWS else p.subject, jobs[p.dtype], spec,
                                        bool(report.get("accelerator")))
        assert on.read_gb_s is not None  # measured before any row
        row.notes.append(reads.note(row.measured("decode_tok_s"), on.read_gb_s.value))
        if exported:
            row.notes.append(exported)
    return row


def run_vllm_row(p: Planned, checkpoint: Path, exported: str | None, work: Path, jobs: dict[str, Job], spec: Any,
             on: Machine, threads: int, time_limit_s: float, log: Any) -> Row:
    """vLLM on one request (``linnet.bench.vllm_rows``), on the checkpoint every row loads, or (``vllm:linnet-export``)
    on Linnet's Hugging Face export of it, written in the row's dtype."""
    reason = vllm_rows.missing()
    if reason:
        return vllm_rows.not_run(p.id, reason)
    model_dir, origin = checkpoint, exported
    if p.id == vllm_rows.EXPORT:
        if exported:
            return vllm_rows.not_run(p.id, "the model is a GGUF file, which vLLM does not load: the vllm row "
                                           "already runs on Linnet's Hugging Face export of it")
        from linnet.hf.export import export_hf

        started = time.monotonic()
        try:
            model_dir = export_hf(open_model(str(checkpoint)), work / "vllm-linnet-export", p.dtype, force=True)
        except LinnetError as e:
            return vllm_rows.not_run(p.id, f"linnet.hf.export refused the model: {e}")
        origin = (f"linnet.hf.export in {p.dtype} ({time.monotonic() - started:.0f} s), then vLLM on the exported "
                  "checkpoint")
    from linnet.bench.serving_servers import vllm_kv_cache_bytes

    protocol = jobs[p.dtype].protocol
    kv_bytes = vllm_kv_cache_bytes(model_dir, 1, protocol.prompt_tokens + protocol.new_tokens, p.dtype)
    report = vllm_rows.run_vllm(p.id, work / f"job-{p.dtype}.json", model_dir, kv_bytes,
                                vllm_rows.vllm_environment(threads), protocol, time_limit_s, log)
    return _row(p, report, jobs, work, spec, on, origin, make=vllm_rows.make_vllm_row)


def serving_row(p: Planned, checkpoint: str, profile: str, threads: int, time_limit_s: float, log: Any) -> Row:
    """One server under linnet.bench.serving's load, in a process of its own (``python -m linnet.bench.all``)
    killed with its server at the time limit."""
    command = [sys.executable, "-P", "-m", "linnet.bench.all", checkpoint, p.subject, SERVING_PROFILES[profile],
               p.dtype, str(threads)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log if hasattr(log, "fileno") else None,
                             text=True, env=importable_here(dict(os.environ)), start_new_session=True)
    try:
        out, _ = child.communicate(timeout=time_limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return Row(p.id, SERVING_GROUP, p.id, not_run=f"time limit of {time_limit_s:g} s")
    except BaseException:
        os.killpg(child.pid, signal.SIGKILL)
        raise
    if child.returncode != 0 or not out.strip():
        return Row(p.id, SERVING_GROUP, p.id, not_run=f"failed: exited with status {child.returncode}")
    return parse(Row, json.loads(out.splitlines()[-1]), p.id, ResultsError)


def _save(results: Results, planned: list[Planned], rows: dict[str, Row], out: Path) -> Results:
    """Rows in plan order (then any others), comparisons recomputed, written whole."""
    order = {p.id: i for i, p in enumerate(planned)}
    ordered = sorted(rows.values(), key=lambda r: order.get(r.id, len(order)))
    add_comparisons(ordered)
    serving = _serving()
    if serving is not None:
        serving.add_comparisons([r for r in ordered if r.group == SERVING_GROUP])
    results = replace(results, rows=ordered)
    save_results(results, out)
    return results


def add_comparisons(rows: list[Row]) -> None:
    """Each Linnet decode row against the stack it replaces: the fastest peer of its group that ran, else the
    fastest peer of all; vLLM on Linnet's export against vLLM on the checkpoint."""
    peers = [r for r in rows if r.id in PEERS and r.not_run is None and r.value("decode_tok_s")]
    ran = {r.id: r for r in rows if r.not_run is None and r.value("decode_tok_s")}
    if vllm_rows.EXPORT in ran and "vllm" in ran:  # the same engine on Linnet's export: a change, not a win
        export, original = ran[vllm_rows.EXPORT], ran["vllm"]
        export.against = Against("vllm", "decode_tok_s",
                                 export.measured("decode_tok_s") / original.measured("decode_tok_s"), export=True)
    for row in rows:
        if not (row.linnet and row.not_run is None and row.value("decode_tok_s")) or not peers:
            continue
        mine = [r for r in peers if r.group == row.group] or peers
        best = max(mine, key=lambda r: r.measured("decode_tok_s"))
        row.against = Against(best.id, "decode_tok_s", row.measured("decode_tok_s") / best.measured("decode_tok_s"))


if __name__ == "__main__":  # one serving row, for serving_row: MODEL SERVER PROFILE DTYPE THREADS
    from linnet.bench import serving as _bench_serving

    model, server, serving_profile, dtype, threads = sys.argv[1:]
    [served] = _bench_serving.serving_rows(model, [server], _bench_serving.PROFILES[serving_profile], dtype,
                                           int(threads), sys.stderr)
    print(json.dumps(dataclasses.asdict(served)), flush=True)
