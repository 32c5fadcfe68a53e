"""``linnet bench --speculate``: one Linnet backend's decode with and without speculative decoding on the
workload prompts (``linnet.bench.workloads``), in one process, the two taking turns a generation each.

Each prompt is a row: the median decode speed of each over ``runs`` generations (after one untimed
each), their ratio, the drafts' acceptance, and whether the tokens were the same (greedy: they must
be, up to the backend's own difference between its prompt and decode arithmetic; docs/SPECULATIVE.md).
"""
from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

from linnet.backends.runner import Runner
from linnet.bench.workloads import chat_ids, workload_prompts
from linnet.generation import generate
from linnet.speculative import Speculator
from linnet.tokenizer import Tokenizer


@dataclass(frozen=True)
class SpeculationRow:
    kind: str
    prompt_tokens: int
    new_tokens: int
    plain_tok_s: float
    speculative_tok_s: float
    drafted: int
    accepted: int
    same_tokens: bool

    @property
    def ratio(self) -> float:
        return self.speculative_tok_s / self.plain_tok_s if self.plain_tok_s else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "ratio": round(self.ratio, 3), "acceptance": round(self.acceptance, 3)}


def run_speculation_bench(runner: Runner, tokenizer: Tokenizer, speculator: Callable[[], Speculator],
                          workload: str, new_tokens: int, runs: int) -> list[SpeculationRow]:
    rows = []
    for kind, prompt in workload_prompts(workload):
        ids = chat_ids(tokenizer, prompt)
        plain, fast, drafted, accepted, same = [], [], 0, 0, True
        for run in range(runs + 1):  # the first of each pays any warming up, untimed
            a = generate(runner, ids, new_tokens, tokenizer=tokenizer)
            spec = speculator()
            b = generate(runner, ids, new_tokens, tokenizer=tokenizer, speculator=spec)
            same = same and a.token_ids == b.token_ids
            if run:
                plain.append(a.decode_tok_s)
                fast.append(b.decode_tok_s)
                drafted, accepted = drafted + spec.drafted, accepted + spec.accepted
        rows.append(SpeculationRow(kind, len(ids), len(b.token_ids), statistics.median(plain),
                                   statistics.median(fast), drafted, accepted, same))
    return rows


def format_rows(rows: list[SpeculationRow], described: str) -> str:
    lines = [described, f"load average {os.getloadavg()[0]:.2f} after", "",
             f"{'kind':<9} {'prompt':>6} {'new':>4} {'plain tok/s':>11} {'spec tok/s':>10} {'ratio':>6} "
             f"{'accepted':>13} {'same':>5}"]
    for r in rows:
        lines.append(f"{r.kind:<9} {r.prompt_tokens:>6} {r.new_tokens:>4} {r.plain_tok_s:>11.1f} "
                     f"{r.speculative_tok_s:>10.1f} {r.ratio:>5.2f}x {r.accepted:>5}/{r.drafted:<5} "
                     f"{r.acceptance:>4.0%} {'yes' if r.same_tokens else 'NO':>4}")
    return "\n".join(lines)
