"""The printed summary of a run: every number, then each Linnet row against each peer's row."""
from __future__ import annotations

from collections.abc import Sequence

from linnet.bench.bandwidth import measured, read_rate
from linnet.bench.protocol import PEERS
from linnet.results import SERVING_GROUP, Results, Row


def format_results(results: Results) -> str:
    m = results.machine
    p = results.protocol
    lines = [
        f"{results.model} · {p.prompt_tokens} prompt tokens, {p.new_tokens} new · batch {p.batch} · "
        f"median of {p.runs} runs after {p.warmups} warm-ups · {results.timestamp}",
        f"{m.accelerator or 'no accelerator'} · {m.cpu} · {m.memory_gib} GiB · {m.threads} threads · "
        f"load average {' '.join(f'{x:.2f}' for x in m.load_average or [])} at the start{measured(m)}",
        " · ".join(f"{k} {v}" for k, v in results.versions.items()),
        "",
    ]
    serving = [r for r in results.rows if r.group == SERVING_GROUP]
    rows = [r for r in results.rows if r.group != SERVING_GROUP]
    table = [("Method", "First token", "Decode", "Reads", "Load", "Peak memory", "Distance")]
    for r in rows:
        if not r.not_run:
            table.append((r.name, f"{r.value('ttft_ms'):,.1f} ms", f"{r.value('decode_tok_s'):.2f} tok/s",
                          read_rate(r, m), f"{r.value('load_s'):.2f} s", f"{r.value('peak_mem_gib'):.2f} GiB",
                          _distance(r)))
    lines += _columns(table)
    lines += [f"{r.name}: not run: {r.not_run}" for r in rows if r.not_run]
    peers = [r for r in rows if r.id in PEERS]
    ratios = [("Against (same run)", *(f"{what} vs {peer.name}" for peer in peers
                                       for what in ("decode", "TTFT", "load")))]
    for r in rows:
        if r.linnet and not r.not_run:
            ratios.append((r.name, *(_ratio(r, peer, metric)
                                     for peer in peers for metric in ("decode_tok_s", "ttft_ms", "load_s"))))
    if peers and len(ratios) > 1:
        lines += ["", *_columns(ratios)]
    if serving:
        from linnet.bench.serving import serving_table  # imports the HTTP client

        lines += ["", f"Serving: {serving[0].notes[0] if serving[0].notes else ''}", *serving_table(serving)]
    lines += ["", "Notes:"] + [f"  {r.name}: {'; '.join(r.notes)}" for r in results.rows if r.notes]
    return "\n".join(lines)


def _distance(row: Row) -> str:
    if row.distance == "reference":
        return "0 (the reference)"
    return row.distance if isinstance(row.distance, str) else f"{row.distance:.3g}"


def _ratio(row: Row, peer: Row, metric: str) -> str:
    """How many times better than the peer: faster decode, shorter first token or load."""
    if peer.not_run:
        return "–"
    mine, theirs = row.measured(metric), peer.measured(metric)
    return f"{mine / theirs if metric == 'decode_tok_s' else theirs / mine:.2f}×"


def _columns(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
